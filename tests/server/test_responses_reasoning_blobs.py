"""`include: ["reasoning.encrypted_content"]`, as stateless clients (store false) ask for it: each
reasoning item carries its text as a blob, whole and streamed, and the blob sent back with the next
turn puts that reasoning in the prompt as its text would. The tool-calling tests' server (tool_server,
conftest: hermes tools, qwen3 reasoning, Qwen3's chat template) answers them."""

from __future__ import annotations

import base64
import zlib

import httpx
import openai
import pytest

from nanoserve.server import reasoning_state
from nanoserve.server.errors import APIError
from tests.server.conftest import openai_client

THINKING = {"structured_outputs": {"regex": "<think>\nabc def\n</think>\n\nAnswer here"}}
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai_client(tool_server.url, timeout=300)


def input_tokens(url: str, reasoning: dict | None) -> httpx.Response:
    """The prompt's tokens for a turn whose call followed `reasoning` (the template keeps the reasoning
    of the turn after the last user message)."""
    items = [{"role": "user", "content": "Weather in Paris?"}, *([reasoning] if reasoning else []), CALL,
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    return httpx.post(f"{url}/v1/responses/input_tokens", json={"model": "tiny", "input": items, "tools": [WEATHER]},
                      timeout=60)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_reasoning_item_carries_its_text_as_a_blob_when_included(client, stream):
    body = dict(model="tiny", input="Think.", max_output_tokens=60, temperature=0, store=False,
                include=[reasoning_state.INCLUDE], extra_body=THINKING)
    if stream:
        events = list(client.responses.create(stream=True, **body))
        (done,) = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "reasoning"]
        response = events[-1].response
        assert response.output[0].encrypted_content == done.encrypted_content
    else:
        response = client.responses.create(**body)
    item = response.output[0]
    assert item.type == "reasoning" and item.content[0].text.strip() == "abc def"
    assert item.encrypted_content.startswith(reasoning_state.PREFIX)
    assert reasoning_state.Unpacker().text(item.encrypted_content, "p") == item.content[0].text
    without = client.responses.create(**{**body, "include": None})
    assert without.output[0].type == "reasoning" and without.output[0].encrypted_content is None


def test_a_blob_sent_back_puts_its_reasoning_in_the_prompt_as_its_text_would(client, tool_server):
    answer = client.responses.create(model="tiny", input="Think.", max_output_tokens=60, temperature=0,
                                     include=[reasoning_state.INCLUDE], extra_body=THINKING)
    blob, text = answer.output[0].encrypted_content, answer.output[0].content[0].text
    as_text = input_tokens(tool_server.url, {"type": "reasoning", "summary": [],
                                             "content": [{"type": "reasoning_text", "text": text}]})
    as_blob = input_tokens(tool_server.url, {"type": "reasoning", "summary": [], "encrypted_content": blob})
    # the blob holds the whole reasoning: it goes back rather than a summary beside it
    summary = [{"type": "summary_text", "text": "A summary of it, in more words than it had."}]
    summed_up = input_tokens(tool_server.url, {"type": "reasoning", "encrypted_content": blob, "summary": summary})
    none = input_tokens(tool_server.url, None)
    assert as_text.status_code == as_blob.status_code == none.status_code == 200, (as_blob.text, none.text)
    assert as_blob.json()["input_tokens"] == as_text.json()["input_tokens"] > none.json()["input_tokens"]
    assert summed_up.json()["input_tokens"] == as_text.json()["input_tokens"], summed_up.text
    # a blob written elsewhere (OpenAI's encrypted reasoning) cannot be read here: the item adds nothing
    foreign = input_tokens(tool_server.url, {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAABp"})
    assert foreign.json()["input_tokens"] == none.json()["input_tokens"], foreign.text


@pytest.mark.parametrize("payload, words", [
    (b"not zlib at all", "not one this server wrote whole"),
    (zlib.compress("\nabc def".encode())[:-3], "not one this server wrote whole"),
    (zlib.compress(b"\xff\xfe"), "not one this server wrote whole"),
    # a small blob that unpacks past the bound: refused before it is all unpacked
    (zlib.compress(bytes(reasoning_state.MAX_UNPACKED_BYTES + 1), 9), "bytes of text"),
], ids=["not zlib", "cut short", "not UTF-8", "too large unpacked"])
def test_a_broken_blob_of_this_servers_is_refused_naming_it(tool_server, payload, words):
    blob = reasoning_state.PREFIX + base64.urlsafe_b64encode(payload).decode()
    r = input_tokens(tool_server.url, {"type": "reasoning", "summary": [], "encrypted_content": blob})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input.1.encrypted_content" and words in error["message"], error


def test_blobs_of_one_request_unpack_within_one_bound_between_them():
    blob = reasoning_state.pack("x" * 600)
    unpacker = reasoning_state.Unpacker(limit=1000)
    assert unpacker.text(blob, "input.0.encrypted_content") == "x" * 600
    with pytest.raises(APIError, match="bytes of text") as refused:
        unpacker.text(blob, "input.1.encrypted_content")
    assert refused.value.param == "input.1.encrypted_content"


def test_a_request_that_replays_a_blob_is_read_and_rendered_off_the_event_loop(server_model, monkeypatch):
    # a blob of 43 kB unpacked to 32 MiB in 0.17 s of the event loop, every other stream waiting, and
    # the render of that reasoning came after: the body's length, which decides where a request is
    # read and rendered, says nothing of what its blobs unpack to
    from nanoserve.server import chat, responses
    from tests.server.conftest import calling_threads, serving, tiny_engine

    read_on = calling_threads(monkeypatch, responses, "as_chat_request")
    rendered_on = calling_threads(monkeypatch, chat, "ChatCompletion")
    with serving(tiny_engine(server_model)) as (url, loop_thread):
        for reasoning in ({"type": "reasoning", "summary": [{"type": "summary_text", "text": "plain"}]},
                          {"type": "reasoning", "summary": [], "encrypted_content": reasoning_state.pack("packed")}):
            items = [{"role": "user", "content": "hi"}, reasoning, {"role": "assistant", "content": "ok"},
                     {"role": "user", "content": "and?"}]
            for route in ("/v1/responses/input_tokens", "/v1/responses"):
                r = httpx.post(f"{url}{route}", json={"model": "tiny", "input": items, "max_output_tokens": 2},
                               timeout=60)
                assert r.status_code == 200, r.text
    assert [thread is loop_thread for thread in read_on] == [True, True, False, False]
    assert [thread is loop_thread for thread in rendered_on] == [True, False]
