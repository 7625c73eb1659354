"""Tool calling, reasoning and LangChain against a real server: the bundled model prompted with
Qwen3's chat template (tests/assets), `--tool-call-parser hermes --reasoning-parser qwen3`.

The model never learnt to call tools; `required` and named tool_choice make it call anyway
(structured decoding), and guided_regex stands in for a trained model where a test needs the
model to write a call or a <think> block on its own."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import openai_client

MAX_TOKENS = 300


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


class Add(BaseModel):
    """Add two integers."""

    a: int = Field(ge=-1000, le=1000)
    b: int = Field(ge=-1000, le=1000)


def tool(model: type[BaseModel]) -> dict:
    return {"type": "function", "function": {"name": model.__name__, "description": model.__doc__,
                                             "parameters": model.model_json_schema()}}


TOOLS = [tool(GetWeather), tool(Add)]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai_client(tool_server.url, timeout=300)


def streamed_message(chunks) -> tuple[str, list[dict], str | None, str]:
    """(content, tool calls, finish reason, reasoning) reassembled from stream chunks."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            extra = d.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")   # vLLM's name and the older one
            reasoning += extra.get("reasoning") or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function.name  # OpenAI's order: id and name first
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, reasoning


def check_call(name: str, arguments: str) -> BaseModel:
    return {"GetWeather": GetWeather, "Add": Add}[name].model_validate_json(arguments)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "Add"}}],
                         ids=["required", "named"])
def test_enforced_tool_choice_gives_a_valid_call_whole_and_streamed(client, choice):
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=MAX_TOKENS,
                  temperature=0, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert len(message.tool_calls) == 1 and message.tool_calls[0].id and message.tool_calls[0].type == "function"
    call = message.tool_calls[0].function
    check_call(call.name, call.arguments)
    assert whole.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
    content, calls, finish, _ = streamed_message(client.chat.completions.create(**kwargs, stream=True))
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.name, call.arguments)]
    assert finish == whole.choices[0].finish_reason and not content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "ping"}}],
                         ids=["required", "named"])
def test_a_function_given_no_parameters_is_called_with_none(client, choice):
    # OpenAI: omitting parameters defines a function with an empty parameter list. Its calls were
    # held to any object, and this model filled it with keys of its own ('{">" : "      | "}')
    kwargs = dict(model="tiny", messages=MESSAGES, tools=[{"type": "function", "function": {"name": "ping"}}],
                  tool_choice=choice, max_tokens=MAX_TOKENS, temperature=0, parallel_tool_calls=False)
    (call,) = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("ping", {})


def test_required_with_three_sampled_choices_each_call_validly(client):
    # one call each (parallel_tool_calls false): sampled freely, this model would keep adding calls
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         max_tokens=MAX_TOKENS, temperature=1.0, seed=4, n=3,
                                         parallel_tool_calls=False)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call.function.name, call.function.arguments)


def test_a_call_a_stop_string_cuts_off_after_its_name_is_the_same_call_whole_and_streamed(client):
    # the stream has announced the call by its name before the stop string ends the output: the
    # whole message said "no call" and gave the cut-off JSON as content
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS,
                  temperature=0, stop=["parameters"])
    whole = client.chat.completions.create(**kwargs)
    content, calls, finish, _ = streamed_message(client.chat.completions.create(**kwargs, stream=True))
    assert calls and calls[0]["name"] in ("GetWeather", "Add")
    message = whole.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == \
        [(c["name"], c["arguments"]) for c in calls]
    assert (message.content or "") == content and whole.choices[0].finish_reason == finish


# two tools whose schemas name a definition alike, each under its own $defs, as pydantic writes
# a nested model's schema (`openai.pydantic_function_tool`)
DEFS_TOOLS = [
    {"type": "function", "function": {"name": "Pick", "parameters": {
        "$defs": {"Item": {"type": "integer", "minimum": 0, "maximum": 9}},
        "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"]}}},
    {"type": "function", "function": {"name": "Tag", "parameters": {   # a property may be called "enum"
        "$defs": {"Item": {"type": "string", "maxLength": 3}}, "type": "object",
        "properties": {"item": {"$ref": "#/$defs/Item"}, "enum": {"$ref": "#/$defs/Item"}}, "required": ["item"]}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_required_enforces_tools_whose_schemas_refer_to_their_own_defs(client, stream):
    # a `$ref` is a pointer from the root of the tool's own schema; `required` set every tool's
    # schema inside one array-of-calls schema, where "#/$defs/Item" named nothing: a 400 for valid tools
    kwargs = dict(model="tiny", messages=MESSAGES, tools=DEFS_TOOLS, tool_choice="required", max_tokens=MAX_TOKENS,
                  temperature=0, parallel_tool_calls=False)
    if stream:
        _, calls, finish, _ = streamed_message(client.chat.completions.create(**kwargs, stream=True))
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish = choice.finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    assert finish == "tool_calls" and len(calls) == 1
    item = json.loads(calls[0]["arguments"])["item"]
    if calls[0]["name"] == "Pick":   # each call holds to its own tool's Item, not the other's
        assert isinstance(item, int) and 0 <= item <= 9
    else:
        assert calls[0]["name"] == "Tag" and isinstance(item, str) and len(item) <= 3


HERMES_CALL = r'<tool_call>\n\{"name": "GetWeather", "arguments": \{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}\n</tool_call>'


def test_auto_reads_the_call_a_model_writes_whole_and_streamed(client):
    # guided_regex makes the untrained model write what Qwen3 writes when it calls a tool
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"guided_regex": HERMES_CALL, "chat_template_kwargs": {"enable_thinking": False}})
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "tool_calls"
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "GetWeather" and check_call("GetWeather", call.function.arguments).unit == "celsius"
    assert not whole.choices[0].message.content
    content, calls, finish, _ = streamed_message(client.chat.completions.create(**kwargs, stream=True))
    assert [(c["name"], c["arguments"]) for c in calls] == [("GetWeather", call.function.arguments)]
    assert finish == "tool_calls" and not content


def test_a_call_whose_name_ends_the_output_is_the_same_call_whole_and_streamed(client):
    # the name's closing quote starts the stop string, so it is held back until the last update,
    # the first in which the stream sees the name (max_tokens can end a call there too): the
    # stream sent the call's own text as content beside the call, which the whole message has not
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0,
                  stop=['", "arguments"'], extra_body={"guided_regex": HERMES_CALL, "include_stop_str_in_output": True,
                                                       "chat_template_kwargs": {"enable_thinking": False}})
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("GetWeather", "")]
    content, calls, finish, _ = streamed_message(client.chat.completions.create(**kwargs, stream=True))
    assert [(c["name"], c["arguments"]) for c in calls] == [("GetWeather", "")]
    assert not message.content and not content and finish == whole.choices[0].finish_reason


def test_a_call_object_that_names_no_function_leaves_the_output_content_whole_and_streamed(client):
    # whole, the object was dropped and the call after it kept; the stream waited at the object
    # for a name and sent nothing at all: no call, and no content
    regex = r'<tool_call>\n\{"city": "Paris"\}\n</tool_call>\n' + HERMES_CALL
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"guided_regex": regex, "chat_template_kwargs": {"enable_thinking": False}})
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert message.tool_calls is None and message.content.startswith('<tool_call>\n{"city": "Paris"}')
    content, calls, finish, _ = streamed_message(client.chat.completions.create(**kwargs, stream=True))
    assert (content, calls, finish) == (message.content, [], whole.choices[0].finish_reason)


def call_of(client, regex: str, stream: bool, **fields) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish reason) of the calls `regex` makes the model write."""
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0, **fields,
                  extra_body={"guided_regex": regex, "chat_template_kwargs": {"enable_thinking": False}})
    if stream:
        content, calls, finish, _ = streamed_message(client.chat.completions.create(**kwargs, stream=True))
        return content or None, [(c["name"], c["arguments"]) for c in calls], finish
    choice = client.chat.completions.create(**kwargs).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_call_that_writes_its_arguments_before_its_name_names_its_function(client, stream):
    # streamed, the first "name" key was taken for the call's, though it was an argument's: a
    # call of "Lyon" (the arguments' name) went out, where the whole message said GetWeather
    regex = (r'<tool_call>\n\{"arguments": \{"name": "Lyon", "city": "Paris", "unit": "celsius"\}, '
             r'"name": "GetWeather"\}\n</tool_call>')
    assert call_of(client, regex, stream) == (
        None, [("GetWeather", '{"name": "Lyon", "city": "Paris", "unit": "celsius"}')], "tool_calls")


def model_ended(regex: str) -> str:
    """The text a regex of plain characters and escaped ones makes the model write."""
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), regex)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_call_left_open_before_its_end_tag_is_content_whole_and_has_its_arguments_streamed(client, stream):
    # a model that forgets the object's closing braces: the block still ends at its tag, but the
    # stream sent the tag's characters as arguments while they might yet have been the object's.
    # Its arguments are no JSON a client can run the call with: the finish stays "stop", and the
    # whole message, which can still choose, answers with the text (as vLLM's parsers do: the
    # openai client's parse() raised on such a call)
    regex = r'<tool_call>\n\{"name": "GetWeather", "arguments": \{"city": "Paris" </tool_call>'
    expected = (None, [("GetWeather", '{"city": "Paris"')], "stop") if stream else (model_ended(regex), [], "stop")
    assert call_of(client, regex, stream) == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_call_cut_by_a_stop_string_or_the_end_of_the_text_is_not_finished_as_tool_calls(client, stream):
    # "tool_calls" told the client to run a call whose arguments json.loads could not read
    whole = r'<tool_call>\n\{"name": "GetWeather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
    assert call_of(client, whole, stream) == (None, [("GetWeather", '{"city": "Paris"}')], "tool_calls")
    assert call_of(client, whole, stream, stop=["Paris"]) == (None, [("GetWeather", '{"city": "')], "stop")
    # the model's end inside them, or NaN (Python's json.loads's, not JSON's: strict parsers refuse
    # such arguments): streamed, the call as sent; whole, the text, as no call a client can run
    ended = r'<tool_call>\n\{"name": "GetWeather", "arguments": \{"city": "Pa'
    nan = r'<tool_call>\n\{"name": "GetWeather", "arguments": \{"days": NaN\}\}\n</tool_call>'
    for regex, arguments in ((ended, '{"city": "Pa'), (nan, '{"days": NaN}')):
        expected = (None, [("GetWeather", arguments)], "stop") if stream else (model_ended(regex), [], "stop")
        assert call_of(client, regex, stream) == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_call_whose_name_is_no_string_is_content_not_a_call(client, stream):
    # the object's name went through str(): a call of the function "{'city': 'Paris'}" (or "5"),
    # where vLLM, which reads no such call, answers with the text as content
    text = '<tool_call>\n{"name": {"city": "Paris"}, "arguments": {}}\n</tool_call>'
    regex = r'<tool_call>\n\{"name": \{"city": "Paris"\}, "arguments": \{\}\}\n</tool_call>'
    assert call_of(client, regex, stream) == (text, [], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_call_whose_name_escapes_a_lone_surrogate_is_answered_with_a_replacement_character(client, stream):
    # json.loads turns "\\ud800" into a code point UTF-8 cannot encode: the body was a 500 and
    # the stream was cut off without an error or [DONE]
    regex = r'<tool_call>\n\{"name": "Get\\ud800", "arguments": \{"city": "\\udc00"\}\}\n</tool_call>'
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"guided_regex": regex, "chat_template_kwargs": {"enable_thinking": False}})
    if stream:
        _, calls, finish, _ = streamed_message(client.chat.completions.create(**kwargs, stream=True))
        name, arguments = calls[0]["name"], calls[0]["arguments"]
    else:
        whole = client.chat.completions.create(**kwargs)
        (call,) = whole.choices[0].message.tool_calls
        name, arguments, finish = call.function.name, call.function.arguments, whole.choices[0].finish_reason
    assert (name, finish) == ("Get\ufffd", "tool_calls")
    assert json.loads(arguments) == {"city": "\udc00"}   # the model's own text, escape and all


def test_auto_without_a_call_is_plain_content(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_is_split_from_content(client, stream):
    body = dict(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=stream,
                extra_body={"guided_regex": r"<think>[a-z ]{5,30}</think>[a-z ]{3,20}"})
    if stream:
        content, _, finish, reasoning = streamed_message(client.chat.completions.create(**body))
    else:
        message = client.chat.completions.create(**body).choices[0].message
        content, reasoning = message.content, message.model_extra["reasoning"]
        assert message.model_extra["reasoning_content"] == reasoning
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert content and "think" not in content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_think_tag_the_user_writes_does_not_make_the_answer_reasoning(client, stream):
    # whether the template opened the reasoning was read from the prompt's last 16 tokens, which
    # held the user's own "<think>": the whole answer came back as reasoning, and content null
    body = dict(model="tiny", messages=[{"role": "user", "content": "What is <think> for?"}], max_tokens=MAX_TOKENS,
                temperature=0, stream=stream, extra_body={"guided_regex": r"[a-z ]{3,20}"})
    if stream:
        content, _, _, reasoning = streamed_message(client.chat.completions.create(**body))
    else:
        message = client.chat.completions.create(**body).choices[0].message
        content, reasoning = message.content, message.model_extra.get("reasoning")
    assert content and not reasoning
    # a "<think>" the template itself leaves open (here: a prefilled answer it continues) still is
    prefilled = client.chat.completions.create(
        model="tiny", messages=[*MESSAGES, {"role": "assistant", "content": "<think>"}], max_tokens=8, temperature=0,
        extra_body={"guided_regex": r"[a-z ]{3,20}", "add_generation_prompt": False, "continue_final_message": True})
    assert prefilled.choices[0].message.model_extra.get("reasoning") and not prefilled.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_output_that_opens_the_think_the_prompt_left_open_is_split_alike_whole_and_streamed(client, stream):
    # streamed, the tag's first characters went out as reasoning before it was known to be the
    # tag, and the reasoning after it came back short by as many: "<think I think." for "Paris, I think."
    body = dict(model="tiny", messages=[*MESSAGES, {"role": "assistant", "content": "<think>\n"}], max_tokens=60,
                temperature=0, stream=stream, extra_body={
                    "guided_regex": r"<think>Paris, I think\.</think>Paris", "add_generation_prompt": False,
                    "continue_final_message": True})
    if stream:
        content, _, _, reasoning = streamed_message(client.chat.completions.create(**body))
    else:
        message = client.chat.completions.create(**body).choices[0].message
        content, reasoning = message.content, message.model_extra.get("reasoning")
    assert (reasoning, content) == ("Paris, I think.", "Paris")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_include_reasoning_false_drops_the_reasoning_and_keeps_the_answer(client, stream):
    body = dict(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=stream,
                extra_body={"guided_regex": r"<think>[a-z ]{5,30}</think>[a-z ]{3,20}", "include_reasoning": False})
    if stream:
        chunks = list(client.chat.completions.create(**body))
        assert not any({"reasoning", "reasoning_content"} & set(c.choices[0].delta.model_extra or {})
                       for c in chunks if c.choices)
        content = streamed_message(chunks)[0]
    else:
        message = client.chat.completions.create(**body).choices[0].message
        assert not {"reasoning", "reasoning_content"} & set(message.model_extra)
        content = message.content
    assert content and "think" not in content


def test_streamed_chunks_each_show_something_and_carry_every_token_logprob(tool_server):
    # text the reasoning parser holds back (a tag being written) went out as chunks with an empty
    # delta; vLLM sends none, and the held tokens' logprobs belong with the text they make
    body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True, "stream": True,
            "stream_options": {"include_usage": True}, "guided_regex": r"<think>[a-z ]{5,30}</think>[a-z ]{3,20}"}
    with httpx.stream("POST", f"{tool_server.url}/v1/chat/completions", json=body, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    *text_chunks, last = chunks
    assert [c for c in text_chunks if not c["choices"][0]["delta"] and not c["choices"][0]["finish_reason"]] == []
    logprobs = [t for c in text_chunks for t in (c["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert len(logprobs) == last["usage"]["completion_tokens"]


def test_auto_tool_choice_needs_the_server_flags(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "tools": TOOLS},
                   timeout=30)
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"].get("tool_calls") is None


# ---- LangChain, offline against 127.0.0.1

@pytest.fixture(scope="module")
def chat_model(tool_server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="tiny", base_url=f"{tool_server.url}/v1", api_key="unused", temperature=0,
                      max_tokens=MAX_TOKENS, max_retries=0, timeout=300)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_gives_a_validated_object(chat_model, method):
    result = chat_model.with_structured_output(GetWeather, method=method).invoke("Weather in Paris?")
    assert isinstance(result, GetWeather)


def test_langchain_structured_output_json_mode_gives_json(chat_model):
    # json_mode asks only for a JSON object (LangChain does not send the schema): a dict schema
    schema = {"title": "Answer", "description": "Any JSON object", "type": "object"}
    result = chat_model.with_structured_output(schema, method="json_mode").invoke("The answer is")
    assert isinstance(result, dict)


@pytest.mark.parametrize("tool_choice", ["required", "Add"])
def test_langchain_bind_tools_calls_and_streams_the_same_call(chat_model, tool_choice):
    bound = chat_model.bind_tools([GetWeather, Add], tool_choice=tool_choice, parallel_tool_calls=False)
    message = bound.invoke("Add 2 and 3")
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    check_call(call["name"], json.dumps(call["args"]))
    if tool_choice == "Add":
        assert call["name"] == "Add"
    streamed = None
    for chunk in bound.stream("Add 2 and 3"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]
