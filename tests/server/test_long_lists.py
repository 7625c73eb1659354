"""A request's long lists cost time in proportion to their length, and its errors do not repeat them."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from nanoserve.server.protocol import (MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_PROMPTS, MAX_TOOL_CALLS_PER_MESSAGE,
                                       MAX_TOOLS)
from tests.server.conftest import calling_threads, openai_client, serving, tiny_engine

MESSAGES = [{"role": "user", "content": "Hi"}]
# as many as a request may give: checking 50,000 for duplicate names was quadratic, 85 s of the
# event loop, during which every stream froze
MANY_TOOLS = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS)]


def largest_gap_beside(url: str, work) -> tuple[float, object]:
    """The largest pause between a streamed completion's chunks while `work()` runs; and its result."""
    stamps: list[float] = []
    started = threading.Event()

    def neighbour() -> None:
        stream = openai_client(url).completions.create(model="tiny", prompt="Hello", max_tokens=1000,
                                                       stream=True, extra_body={"ignore_eos": True})
        for _ in stream:
            stamps.append(time.monotonic())
            started.set()

    thread = threading.Thread(target=neighbour)
    thread.start()
    assert started.wait(60)
    begun = time.monotonic()
    result = work()
    ended = time.monotonic()
    thread.join(300)
    during = [b - a for a, b in zip(stamps, stamps[1:]) if b >= begun and a <= ended]
    return max(during, default=ended - begun), result


def refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("tool_choice", ["auto", {"type": "function", "function": {"name": "nope"}}])
def test_the_most_tools_a_request_may_give_do_not_freeze_other_streams(server, tool_choice):
    client = openai_client(server.url)
    gap, error = largest_gap_beside(server.url, lambda: refused(lambda: client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=MANY_TOOLS, tool_choice=tool_choice, max_tokens=2)))
    assert error.body["param"] == "tool_choice"
    # the named function is looked for among the tools, and the message lists only a few of them
    assert len(error.body["message"]) < 2000, len(error.body["message"])
    assert gap < 2, f"a stream beside the request paused {gap:.1f} s"
    server.wait_idle()


def test_an_unknown_model_name_is_not_repeated_whole(server):
    error = openai_client(server.url).completions.create
    with pytest.raises(openai.NotFoundError) as caught:
        error(model="m" * 1_000_000, prompt="Hi", max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"
    assert len(caught.value.response.content) < 2000, len(caught.value.response.content)


def test_a_body_of_ten_million_empty_strings_is_refused_without_freezing_other_streams(server):
    # within the body limit, over the value limit: its strings are read without one long regex
    # over the whole body, which held every stream for 2.5 s
    body = b'{"model": "tiny", "max_tokens": 2, "prompt": [' + b'"",' * 10_000_000 + b'""]}'
    gap, r = largest_gap_beside(server.url, lambda: httpx.post(
        f"{server.url}/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=120))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_complex", r.text
    assert "holds about 10000005" in r.json()["error"]["message"]
    assert gap < 1, f"a stream beside the request paused {gap:.1f} s"


def test_required_over_more_tools_than_any_spec_holds_is_refused_before_building_it():
    from nanoserve.server.errors import APIError
    from nanoserve.server.chat_protocol import ChatCompletionRequest
    from nanoserve.server.tools import plan_tools

    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": MANY_TOOLS, "tool_choice": "required"})
    start = time.monotonic()
    with pytest.raises(APIError) as caught:
        plan_tools(req, None, False)
    # building and writing out the schema of 50,000 calls took ~0.9 s of the event loop
    assert time.monotonic() - start < 0.2
    assert caught.value.param == "tools" and f"over {MAX_TOOLS} tools" in caught.value.message


@pytest.mark.parametrize("field, bad", [("stop_token_ids", ["x"] * 500_000), ("prompt", [{}] * 300_000)])
def test_a_list_of_many_bad_items_is_refused_without_freezing_other_streams(server, field, bad):
    # one validation error per bad item (per member of a union): reading 330,000 of them held
    # every stream for 1.3 s, for a 400 that names the first
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, field: bad}
    gap, r = largest_gap_beside(server.url, lambda: httpx.post(f"{server.url}/v1/completions", json=body, timeout=120))
    assert r.status_code == 400 and r.json()["error"]["param"] == f"{field}.0", r.text[:300]
    assert gap < 1, f"a stream beside the request paused {gap:.1f} s"


CALL = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
CHAT_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def past(bound: int, item) -> list:
    return [item] * (bound + 1)


@pytest.mark.parametrize("path, body, param, bound", [
    ("/v1/responses", {"input": past(MAX_MESSAGES, CALL)}, "input", MAX_MESSAGES),
    ("/v1/responses", {"input": [{"role": "user", "content": past(MAX_CONTENT_PARTS, {"type": "input_text",
                                                                                     "text": "a"})}]},
     "input.0.content", MAX_CONTENT_PARTS),
    ("/v1/responses", {"input": "Hi", "tools": past(MAX_TOOLS, {"type": "function", "name": "f"})}, "tools", MAX_TOOLS),
    ("/v1/chat/completions", {"messages": past(MAX_MESSAGES, {"role": "user", "content": ""})}, "messages",
     MAX_MESSAGES),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": past(MAX_CONTENT_PARTS, {"type": "text",
                                                                                               "text": "a"})}]},
     "messages.0.content", MAX_CONTENT_PARTS),
    ("/v1/chat/completions", {"messages": [*MESSAGES, {"role": "assistant", "tool_calls": past(
        MAX_TOOL_CALLS_PER_MESSAGE, CHAT_CALL)}]}, "messages.1.tool_calls", MAX_TOOL_CALLS_PER_MESSAGE),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": MANY_TOOLS + MANY_TOOLS[:1]}, "tools", MAX_TOOLS),
    ("/v1/completions", {"prompt": past(MAX_PROMPTS, "a")}, "prompt", MAX_PROMPTS),
    ("/v1/completions", {"prompt": past(MAX_PROMPTS, [1])}, "prompt", MAX_PROMPTS),
    ("/tokenize", {"messages": past(MAX_MESSAGES, {"role": "user", "content": ""})}, "messages", MAX_MESSAGES),
])
def test_a_list_past_its_bound_is_refused_naming_the_field_and_the_bound(server, path, body, param, bound):
    r = httpx.post(server.url + path, json={"model": "tiny", "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "array_above_max_length", error
    assert error["message"] == (f"Invalid '{param}': array too long. Expected an array with maximum length {bound}, "
                                f"but got an array with length {bound + 1} instead.")


def test_two_hundred_thousand_input_items_are_refused_without_freezing_other_streams(server):
    # each item was validated, translated into a chat message and validated again before the
    # conversation was found too long: ~2 s of the server's time (function calls: 5 s, then served)
    content = json.dumps({"model": "tiny", "input": [{"role": "user", "content": ""}] * 200_000,
                          "max_output_tokens": 2})
    gap, r = largest_gap_beside(server.url, lambda: httpx.post(
        f"{server.url}/v1/responses", content=content, headers={"Content-Type": "application/json"}, timeout=120))
    assert r.status_code == 400 and r.json()["error"]["code"] == "array_above_max_length", r.text[:300]
    assert f"maximum length {MAX_MESSAGES}, but got an array with length 200000" in r.json()["error"]["message"]
    assert gap < 1, f"a stream beside the request paused {gap:.1f} s"


def test_as_many_input_items_as_allowed_are_served(server):
    body = {"model": "tiny", "input": [MESSAGES[0], *[CALL] * (MAX_MESSAGES - 1)], "max_output_tokens": 2}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text[:300]
    server.wait_idle()


def test_instructions_beside_as_many_messages_as_allowed_are_refused_counting_both(server):
    # the instructions are one more message: refused as a chat request of a list too long, 16,385
    # items where the client sent 16,384
    body = {"model": "tiny", "instructions": "Be brief.", "input": [{"role": "user", "content": ""}] * MAX_MESSAGES}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"] == {
        "message": f"'instructions' and 'input' make a conversation of {MAX_MESSAGES + 1} messages; at most "
                   f"{MAX_MESSAGES}", "type": "invalid_request_error", "param": "input",
        "code": "array_above_max_length"}


def test_a_large_conversation_is_measured_off_the_event_loop(server_model, monkeypatch):
    # its text was summed up on the event loop before the render was sent to a worker thread
    # (chat, /tokenize): 20-35 ms of every stream's time at 16,384 messages of parts, or as many tools
    from nanoserve.server import chat

    measured_on = calling_threads(monkeypatch, chat, "messages_length")
    engine = tiny_engine(server_model)
    with serving(engine) as (url, loop_thread):
        parts = [{"type": "text", "text": "a"}] * 15
        for messages in (MESSAGES, [{"role": "user", "content": parts}] * 60):   # a 27 KB body
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 200, r.text[:300]
        r = httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": messages}, timeout=60)
        assert r.status_code == 200, r.text[:300]
    small, large, tokenized = measured_on
    assert small is loop_thread and large is not loop_thread and tokenized is not loop_thread


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", **{f"k{i}": 0 for i in range(400_000)}}, "k0"),
    ("/v1/chat/completions", {"messages": [{**MESSAGES[0], **{f"k{i}": 0 for i in range(400_000)}}]}, "messages.0.k0"),
])
def test_a_body_of_many_unknown_keys_is_refused_without_freezing_other_streams(server, path, body, param):
    # one validation error per unknown key: reading 400,000 of them held every stream for 1.7-2.4 s,
    # for a 400 that names the first. Written beforehand: writing it would hold this process's streams
    content = json.dumps({"model": "tiny", "max_tokens": 2, **body})
    gap, r = largest_gap_beside(server.url, lambda: httpx.post(
        server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=120))
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "unrecognized_argument"
    assert gap < 1, f"a stream beside the request paused {gap:.1f} s"
