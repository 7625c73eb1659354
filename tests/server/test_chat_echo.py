"""vLLM's chat `echo` through the HTTP API, with the real `openai` client: a reply that continues a
message of its own author (a prefilled answer) repeats that message before what it adds."""

from __future__ import annotations

import httpx
import openai
import pytest
from tests.server.conftest import openai_client

CONTINUE = {"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True}
PREFILLED = [{"role": "user", "content": "What is a list?"}, {"role": "assistant", "content": "A list is"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server.url, timeout=120)


def reply(client: openai.OpenAI, messages: list[dict], **extra) -> tuple[str, str, list[str]]:
    """(role, content) of the whole answer, and the streamed content of each of two choices."""
    body = dict(model="tiny", messages=messages, max_tokens=6, temperature=0, n=2)
    whole = client.chat.completions.create(**body, extra_body=extra)
    assert whole.choices[0].message.content == whole.choices[1].message.content
    chunks = list(client.chat.completions.create(**body, stream=True, extra_body=extra))
    assert {choice.delta.role for choice in chunks[0].choices} == {whole.choices[0].message.role}
    streamed = ["".join(choice.delta.content or "" for c in chunks for choice in c.choices if choice.index == i)
                for i in (0, 1)]
    return whole.choices[0].message.role, whole.choices[0].message.content, streamed


def test_echo_repeats_a_continued_assistant_message_whole_and_streamed(client):
    role, continued, _ = reply(client, PREFILLED, **CONTINUE)
    assert role == "assistant" and not continued.startswith("A list is")
    role, echoed, streamed = reply(client, PREFILLED, **CONTINUE, echo=True)
    assert role == "assistant" and echoed == "A list is" + continued
    assert streamed == [echoed, echoed]


def test_echo_repeats_nothing_when_the_reply_is_a_new_assistant_turn_after_a_user(client):
    messages = [{"role": "user", "content": "What is a dict?"}]
    assert reply(client, messages, echo=True, ignore_eos=True) == reply(client, messages, ignore_eos=True)


def test_echo_follows_vllms_rule_of_the_replys_author(client):
    # with a generation prompt the reply is the assistant's: a last assistant message is repeated
    _, new_turn, _ = reply(client, PREFILLED, ignore_eos=True)
    role, echoed, streamed = reply(client, PREFILLED, echo=True, ignore_eos=True)
    assert role == "assistant" and echoed == "A list is" + new_turn and streamed == [echoed, echoed]
    # without one, the reply speaks as the last message's author, whose message it repeats
    user_last = PREFILLED[:1]
    role, plain, _ = reply(client, user_last, add_generation_prompt=False, ignore_eos=True)
    assert role == "user"
    assert reply(client, user_last, add_generation_prompt=False, echo=True, ignore_eos=True)[1:] == (
        "What is a list?" + plain, ["What is a list?" + plain] * 2)


def test_echo_must_be_a_boolean(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": PREFILLED, "echo": "yes"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
