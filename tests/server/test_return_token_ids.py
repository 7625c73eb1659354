"""vLLM's return_token_ids through the HTTP API, with the real `openai` client: completions carry
`prompt_token_ids` and `token_ids` in each choice (streamed: the prompt's with a choice's first
chunk, then each chunk's new ids); chat carries `token_ids` in each choice and `prompt_token_ids`
beside the choices (streamed: in the first chunk)."""

from __future__ import annotations

import openai
import pytest

from nanoserve import SamplingParams
from tests.server.conftest import openai_client

PROMPTS = ["A list is", "The function returns"]
CHAT = [{"role": "user", "content": "What is a dict?"}]
ASK = {"return_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server.url, timeout=120)


def reference(offline, prompt, max_tokens: int = 8):
    return offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)[0]


def test_completion_choices_carry_their_prompt_and_token_ids(client, offline):
    refs = [reference(offline, p) for p in PROMPTS]
    out = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=8, temperature=0, n=2, extra_body=ASK)
    assert len(out.choices) == 4
    for choice in out.choices:
        ref = refs[choice.index // 2]
        assert choice.prompt_token_ids == ref.prompt_token_ids
        assert choice.token_ids == ref.token_ids and choice.text == ref.text
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert "token_ids" not in plain.choices[0].model_extra and "prompt_token_ids" not in plain.choices[0].model_extra


def test_completion_with_echo_keeps_the_prompt_text_and_the_token_ids_apart(client, offline):
    ref = reference(offline, PROMPTS[0])
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, echo=True,
                                    logprobs=1, extra_body=ASK)
    choice = out.choices[0]
    assert choice.text == PROMPTS[0] + ref.text   # the prompt's text stays (vLLM's bug #57996 dropped it)
    assert choice.prompt_token_ids == ref.prompt_token_ids and choice.token_ids == ref.token_ids
    assert len(choice.logprobs.tokens) == len(ref.prompt_token_ids) + 8


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completion_sends_the_prompt_ids_first_then_each_chunks_new_ids(client, offline, echo):
    refs = [reference(offline, p, 12) for p in PROMPTS]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0, stream=True,
                                            echo=echo, extra_body=ASK))
    for index, ref in enumerate(refs):
        mine = [choice for c in chunks for choice in c.choices if choice.index == index]
        assert mine[0].prompt_token_ids == ref.prompt_token_ids
        assert all("prompt_token_ids" not in c.model_extra for c in mine[1:])
        assert [t for c in mine for t in c.token_ids] == ref.token_ids
        assert "".join(c.text for c in mine) == (PROMPTS[index] if echo else "") + ref.text


def test_chat_carries_the_token_ids_of_each_choice_and_of_the_prompt(client, offline):
    text = offline.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    prompt = offline.tokenizer.encode(text, add_special_tokens=False)
    ref = reference(offline, prompt, 10)
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0, n=2,
                                           extra_body=ASK)
    assert whole.prompt_token_ids == prompt
    assert [c.token_ids for c in whole.choices] == [ref.token_ids] * 2
    assert whole.choices[0].message.content == ref.text
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=ASK))
    assert chunks[0].prompt_token_ids == prompt and chunks[0].choices[0].delta.role == "assistant"
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    assert [t for c in chunks[1:] if c.choices for t in c.choices[0].token_ids] == ref.token_ids
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert "prompt_token_ids" not in plain.model_extra and "token_ids" not in plain.choices[0].model_extra


@pytest.mark.parametrize("path, body", [("completions", {"prompt": "x"}),
                                        ("chat/completions", {"messages": CHAT})])
def test_return_token_ids_must_be_a_boolean(server, path, body):
    import httpx

    r = httpx.post(f"{server.url}/v1/{path}", json={**body, "return_token_ids": "yes"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_ids", r.text
