"""/v1/responses through the openai client: the chat path's text, tool calls, reasoning and
structured outputs, answered as Responses output items, whole and as typed events; stored
responses not found (the other refusals: test_responses_refusals.py).

The server runs Qwen3's chat template with the hermes tool parser and the qwen3 reasoning parser,
as the tool-calling tests do; a regex makes the untrained model write a <think> block."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import calling_threads, openai_client, serving, tiny_engine
# tool_server (conftest): the tool-calling tests' server, started again for this file (module scope)

MAX_TOKENS = 300
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"]}}
THINKING = {"structured_outputs": {"regex": "<think>\nabc def\n</think>\n\nAnswer here"}}


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10 ** 7)


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai_client(tool_server.url, timeout=300)


def streamed(client: openai.OpenAI, **kwargs) -> list:
    events = list(client.responses.create(model="tiny", stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1].response
    # every item is announced, then finished, under one id and index, and is the final output's
    added = {e.output_index: e.item.id for e in events if e.type == "response.output_item.added"}
    done = {e.output_index: e.item.id for e in events if e.type == "response.output_item.done"}
    assert added == done == dict(enumerate(item.id for item in final.output))
    # an item comes without its parts, each of which has an event of its own (the SDK's stream
    # helper appends every part it is sent: one given in both made its snapshot hold two)
    assert all(not getattr(e.item, "content", None) for e in events if e.type == "response.output_item.added")
    parts = [e.output_index for e in events if e.type == "response.content_part.added"]
    assert parts == [i for i, item in enumerate(final.output) if item.type != "function_call"]
    return events


def joined(events: list, kind: str) -> str:
    return "".join(e.delta for e in events if e.type == kind)


def test_a_response_says_what_the_same_chat_completion_says(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                                  {"role": "user", "content": "Name a colour."}],
                                          max_tokens=12, temperature=0)
    text, finish = chat.choices[0].message.content, chat.choices[0].finish_reason
    status = "incomplete" if finish == "length" else "completed"
    kwargs = dict(instructions="Be brief.", input="Name a colour.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(model="tiny", **kwargs)
    assert (whole.output_text, whole.status) == (text, status)
    assert [item.type for item in whole.output] == ["message"]
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                    chat.usage.completion_tokens)
    assert (whole.incomplete_details.reason if whole.incomplete_details else None) == \
        ("max_output_tokens" if finish == "length" else None)
    events = streamed(client, **kwargs)
    assert joined(events, "response.output_text.delta") == text
    assert events[-1].type == f"response.{status}" and events[-1].response.output_text == text
    # the same conversation given as items, with the instructions as a system message
    items = client.responses.create(model="tiny", input=[{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": [
                                                             {"type": "input_text", "text": "Name a colour."}]}],
                                    max_output_tokens=12, temperature=0)
    assert items.output_text == text


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_echoes_the_settings_it_was_asked_with_and_when_it_completed(client, stream):
    settings = dict(max_tool_calls=3, top_logprobs=2, prompt_cache_key="k1", safety_identifier="user-7")
    ends = {"completed": dict(max_output_tokens=50, extra_body={"structured_outputs": {"regex": "blue"}}),
            "incomplete": dict(max_output_tokens=1, extra_body={"ignore_eos": True})}
    for status, kwargs in ends.items():
        start = time.time()
        if stream:
            response = streamed(client, input="Name a colour.", **settings, **kwargs)[-1].response
        else:
            response = client.responses.create(model="tiny", input="Name a colour.", **settings, **kwargs)
        assert response.status == status
        assert {name: getattr(response, name) for name in settings} == settings
        if status == "completed":
            assert start - 1 <= response.completed_at <= time.time() + 1
        else:
            assert response.completed_at is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_validates_as_the_clients_own_types_strictly(tool_server, stream):
    """The openai package's models of a Response, every field they require: a schema format given
    no name is echoed with the one it took, and usage says what went into the prefix cache."""
    from openai.types.responses import Response

    body = {"model": "tiny", "input": "A colour as JSON, please. " * 3, "max_output_tokens": 20, "stream": stream,
            "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}
    sent = []
    for _ in range(2):   # the second finds the first one's prompt blocks in the prefix cache
        reply = httpx.post(f"{tool_server.url}/v1/responses", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        if stream:
            final = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")][-1]
            response = Response.model_validate(final["response"], strict=True)
        else:
            response = Response.model_validate(reply.json(), strict=True)
        assert response.text.format.name == "response"
        sent.append(response.usage)
    first, again = sent
    assert first.input_tokens == again.input_tokens > 16
    blocks = first.input_tokens // 16 * 16   # the server's 16-token blocks
    assert first.input_tokens_details.cache_write_tokens == blocks - first.input_tokens_details.cached_tokens
    assert again.input_tokens_details.cached_tokens == blocks and again.input_tokens_details.cache_write_tokens == 0


def test_input_tokens_counts_the_prompt_the_response_would_have(client):
    for kwargs in (dict(input="Name a colour."), dict(instructions="Be brief.", input="Name a colour.", tools=[WEATHER]),
                   dict(input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                        reasoning={"effort": "low"})):
        counted = client.responses.input_tokens.count(model="tiny", **kwargs)
        used = client.responses.create(model="tiny", max_output_tokens=1, **kwargs).usage.input_tokens
        assert counted.object == "response.input_tokens" and counted.input_tokens == used > 0, kwargs
    # past the context it still counts (a client asks to know whether it fits)
    assert client.responses.input_tokens.count(model="tiny", input="word " * 2100).input_tokens > 2048
    with pytest.raises(openai.BadRequestError) as refused:   # refused as /v1/responses refuses it
        client.responses.input_tokens.count(model="tiny", input="Hi", tools=[{**WEATHER, "parameters": {"type": "string"}}])
    assert refused.value.body["param"] == "tools.0.parameters"


def test_a_function_call_is_an_item_whole_and_streamed_and_its_output_goes_back_in(client, tool_server):
    kwargs = dict(input="What is the weather in Paris?", tools=[WEATHER], temperature=0, max_output_tokens=MAX_TOKENS,
                  tool_choice={"type": "function", "name": "get_weather"})
    whole = client.responses.create(model="tiny", **kwargs)
    (call,) = whole.output
    assert (call.type, call.name, whole.status) == ("function_call", "get_weather", "completed")
    assert set(json.loads(call.arguments)) == {"city", "unit"}
    events = streamed(client, **kwargs)
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == joined(events, "response.function_call_arguments.delta") == call.arguments
    assert events[-1].response.output[0].call_id.startswith("call")
    # the call and its result, replayed, render as the chat conversation with the assistant's call
    replay = [{"role": "user", "content": "What is the weather in Paris?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    after = client.responses.create(model="tiny", input=replay, tools=[WEATHER], max_output_tokens=4, temperature=0)
    messages = [replay[0], {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    counted = httpx.post(f"{tool_server.url}/tokenize", json={
        "messages": messages, "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                                          if k != "type"}}]}, timeout=60).json()
    assert after.usage.input_tokens == counted["count"]


def test_reasoning_is_an_item_of_its_own_whole_and_streamed(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Think."}],
                                          max_tokens=60, temperature=0, extra_body=THINKING)
    reasoning, content = chat.choices[0].message.reasoning, chat.choices[0].message.content
    assert reasoning and content
    whole = client.responses.create(model="tiny", input="Think.", max_output_tokens=60, temperature=0,
                                    extra_body=THINKING)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert (whole.output[0].content[0].text, whole.output_text) == (reasoning, content)
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    events = streamed(client, input="Think.", max_output_tokens=60, temperature=0, extra_body=THINKING)
    assert joined(events, "response.reasoning_text.delta") == reasoning
    assert joined(events, "response.output_text.delta") == content


def test_reasoning_with_no_answer_is_the_only_item_whole_and_streamed(client):
    # the whole response added an empty message beside it, which the stream did not
    body = {"input": "Think.", "max_output_tokens": 60, "temperature": 0,
            "extra_body": {"structured_outputs": {"regex": "<think>\nabc def"}}}
    whole = client.responses.create(model="tiny", **body)
    final = streamed(client, **body)[-1].response
    for response in (whole, final):
        assert [item.type for item in response.output] == ["reasoning"], response.output
        assert response.output[0].content[0].text == "\nabc def" and response.output_text == ""


@pytest.mark.parametrize("output", ["<think></think>Answer here", "<think>"], ids=["answered", "alone"])
def test_reasoning_with_no_text_is_no_item_whole_as_streamed(client, output):
    # the whole response had an empty reasoning item that the stream, which opens one for reasoning
    # text, never sent (alone, the stream answered with an empty message instead)
    body = {"input": "Think.", "max_output_tokens": 60, "temperature": 0,
            "extra_body": {"structured_outputs": {"regex": re.escape(output)}}}
    whole = client.responses.create(model="tiny", **body)
    final = streamed(client, **body)[-1].response
    for response in (whole, final):
        assert [item.type for item in response.output] == ["message"], response.output
        assert response.output_text == output.removeprefix("<think>").removeprefix("</think>")


def test_items_before_the_last_of_a_cut_off_response_are_completed_whole_as_streamed(client):
    # the stream closes an item as completed when the next one opens; the whole response gave every
    # item the response's status, so a reasoning or a call that had ended read "incomplete". The last,
    # cut item is incomplete, unless it is a call whose arguments are whole (its tag was cut)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    for output, tools in ((THINKING["structured_outputs"]["regex"], []),
                          (re.escape(call + "\n" + call), [WEATHER])):
        body = {"input": "Think.", "temperature": 0, "tools": tools,
                "extra_body": {"structured_outputs": {"regex": output}}}
        whole = client.responses.create(model="tiny", max_output_tokens=MAX_TOKENS, **body)
        assert whole.status == "completed" and len(whole.output) == 2
        last_statuses = set()
        for short in range(3, 40, 6):   # inside the last item: its tag, then its arguments
            cut = {**body, "max_output_tokens": whole.usage.output_tokens - short}
            whole_cut = client.responses.create(model="tiny", **cut)
            if len(whole_cut.output) < 2:
                break   # cut before the last item's name: no item of it
            for response in (whole_cut, streamed(client, **cut)[-1].response):
                assert response.status == "incomplete" and len(response.output) == 2
                first, last = response.output
                runnable = last.type == "function_call" and whole_json_object(last.arguments)
                assert (first.status, last.status) == ("completed", "completed" if runnable else "incomplete")
                last_statuses.add(last.status)
        assert "incomplete" in last_statuses


def test_parse_and_the_stream_helper_give_a_validated_object(client):
    parsed = client.responses.parse(model="tiny", input="A city as JSON.", text_format=City,
                                    max_output_tokens=MAX_TOKENS, temperature=0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)
    with client.responses.stream(model="tiny", input="A city as JSON.", text_format=City,
                                 max_output_tokens=MAX_TOKENS, temperature=0) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed


def test_instructions_alone_are_answered_as_a_system_message_alone(client, tool_server):
    # OpenAI's API takes a request of instructions and no input; it was refused: "Missing 'input'"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Name a colour."}],
                                          max_tokens=8, temperature=0)
    response = client.responses.create(model="tiny", instructions="Name a colour.", max_output_tokens=8,
                                       temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    r = httpx.post(f"{tool_server.url}/v1/responses", json={"model": "tiny"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_a_client_leaving_mid_stream_frees_its_blocks(tool_server):
    body = {"model": "tiny", "input": "Count.", "max_output_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{tool_server.url}/v1/responses", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert any("response.output_text.delta" in next(lines) for _ in range(40))
    tool_server.wait_idle()
    after = httpx.post(f"{tool_server.url}/v1/responses", json={**body, "stream": False,
                                                                     "max_output_tokens": 3}, timeout=60)
    assert after.json()["usage"]["output_tokens"] == 3


def test_langchain_on_the_responses_api_answers_calls_and_parses(tool_server):
    from langchain_openai import ChatOpenAI

    def model_of(max_tokens: int) -> ChatOpenAI:
        return ChatOpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", model="tiny", use_responses_api=True,
                          temperature=0, max_tokens=max_tokens, max_retries=0)

    model, short = model_of(MAX_TOKENS), model_of(6)
    whole = short.invoke("Hello")
    assert whole.text and whole.usage_metadata["output_tokens"] == 6
    assert "".join(chunk.text for chunk in short.stream("Hello")) == whole.text
    (call,) = model.bind_tools([City], tool_choice="City").invoke("Describe a city.").tool_calls
    assert call["name"] == "City" and City.model_validate(call["args"])
    assert isinstance(model.with_structured_output(City, method="json_schema").invoke("A city."), City)


def test_a_stored_response_is_not_found_by_any_of_the_clients_calls(client):
    for call in (lambda: client.responses.retrieve("resp_abc"), lambda: client.responses.delete("resp_abc"),
                 lambda: client.responses.cancel("resp_abc"), lambda: client.responses.input_items.list("resp_abc")):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert "keeps no responses" in caught.value.body["message"]


def test_replayed_reasoning_joins_in_time_linear_in_its_items() -> None:
    # added up item by item, 20,000 items of 1,000 characters took 77 s on the event loop
    from nanoserve.server.responses_protocol import ResponsesRequest, as_chat_request

    texts = [f"step {i} " + "x" * 1000 for i in range(16_000)]   # within the bound on input items
    items = [{"role": "user", "content": "q"}, *({"type": "reasoning", "summary": [{"text": t}]} for t in texts),
             {"type": "reasoning", "summary": []}, {"role": "assistant", "content": "a"}]
    start = time.process_time()
    chat = as_chat_request(ResponsesRequest.model_validate({"model": "tiny", "input": items}))
    assert time.process_time() - start < 5.0
    assert chat.messages[1].reasoning == "\n".join(texts) and chat.messages[1].content == "a"


def test_a_large_input_becomes_a_chat_request_off_the_event_loop(server_model, monkeypatch) -> None:
    # 240,000 items took 4 s to convert, and every stream waited while they did
    from nanoserve.server import responses

    converted_on = calling_threads(monkeypatch, responses, "as_chat_request")
    engine = tiny_engine(server_model)
    with serving(engine) as (url, loop_thread):
        for thought in ("short", "x" * 20_000):   # an earlier turn's reasoning, which the template drops
            items = [{"role": "user", "content": "q"}, {"type": "reasoning", "summary": [{"text": thought}]},
                     {"role": "assistant", "content": "a"}, {"role": "user", "content": "hello there"}]
            r = httpx.post(f"{url}/v1/responses", json={"model": "tiny", "input": items, "max_output_tokens": 2},
                           timeout=60)
            assert r.status_code == 200, r.text[:300]
    small, large = converted_on
    assert small is loop_thread and large is not loop_thread


@pytest.mark.parametrize("delta", [{"content": "word "}, {"reasoning": "word "},
                                   {"tool_calls": [{"index": 0, "function": {"arguments": "[1, "}}]}])
def test_a_streamed_item_grows_in_place_not_by_a_copy_per_delta(delta):
    # `part["text"] += delta` (and a call's arguments) copied the item's whole text for every delta
    # of a stream: O(n^2) of the event loop in the length of the output. A copy per delta shows as a
    # peak of twice the text (the old and the new one alive at once)
    import tracemalloc

    from nanoserve.server.responses import ResponseWriter

    writer = ResponseWriter.__new__(ResponseWriter)   # apply() needs no request
    writer.items, writer.sequence, writer.open = [], 0, None
    if "tool_calls" in delta:
        writer.apply({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]}, [])
    for _ in range(5000):
        writer.apply(delta, [])
    tracemalloc.start()
    try:
        for _ in range(10000):
            writer.apply(delta, [])
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    item = writer.items[-1]
    text = item["arguments"] if "tool_calls" in delta else item["content"][0]["text"]
    assert len(text) > 50_000
    assert peak - held < 0.5 * len(text)


def test_long_reasoning_is_counted_off_the_event_loop(server_model, monkeypatch) -> None:
    # usage's reasoning_tokens tokenizes the reasoning again: 590 KB took 0.38 s of the event loop
    # (~100k tokens of a long-context model's thinking), every other stream waiting. The tiny model's
    # context holds too little reasoning to pass the inline bound, so the bound is lowered here
    from nanoserve.server import responses, state
    from nanoserve.server.app import build_app
    from nanoserve.server.state import ServerSettings
    from tests.server.conftest import QWEN3_TEMPLATE, in_process_server

    counted_on = calling_threads(monkeypatch, responses, "reasoning_tokens")
    monkeypatch.setattr(state, "_INLINE_TEXT_CHARS", 64)
    settings = ServerSettings(served_model_names=["tiny"], chat_template=QWEN3_TEMPLATE.read_text(),
                              reasoning_parser="qwen3")
    with in_process_server(build_app(tiny_engine(server_model), settings)) as (url, loop_thread):
        for thought in ("short", "long " * 30):
            body = {"model": "tiny", "input": "hi", "max_output_tokens": 200, "temperature": 0,
                    "structured_outputs": {"regex": f"<think>\n{thought}\n</think>\n\nok"}}
            r = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
            assert r.status_code == 200, r.text[:300]
            assert r.json()["output"][0]["content"][0]["text"].strip() == thought.strip()
            assert r.json()["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    short, long = counted_on
    assert short is loop_thread and long is not loop_thread


def whole_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
