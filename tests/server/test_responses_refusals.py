"""What /v1/responses refuses, and how: each bad request gets a 400 that names the field to change,
in the words of the OpenAI API; what this server cannot do (stored responses, hosted tools) is
refused by name. The tool-calling tests' server (tool_server, conftest) answers them."""

from __future__ import annotations

import httpx
import pytest

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}


@pytest.mark.parametrize("tool, param, words", [
    ({"type": "function"}, "tools.0.name", "Missing required parameter: 'tools.0.name'"),
    # chat's form of a tool: the function's fields sit in the tool itself here
    ({"type": "function", "function": {"name": "f"}}, "tools.0.name", "Missing"),
    ({"type": "function", "name": "f", "strict": "yes"}, "tools.0.strict", "Invalid type"),
    ({"type": "function", "name": "f", "parameters": [1]}, "tools.0.parameters", "Invalid type"),
])
def test_a_bad_function_tool_is_refused_naming_its_field(tool_server, tool, param, words):
    # the field was not named: "tools[0]: Field required"
    r = httpx.post(f"{tool_server.url}/v1/responses", json={"model": "tiny", "input": "Hi", "tools": [tool]},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("item, param, words", [
    ({"type": "function_call", "call_id": "c1"}, "input.0.name", "Missing"),
    ({"type": "function_call_output", "call_id": "c1", "output": 5}, "input.0.output", "Invalid type"),
    ({"type": "reasoning", "summary": "thought"}, "input.0.summary", "Invalid type"),
    ({"type": "message", "role": "user"}, "input.0.content", "Missing"),
    ({"role": "user", "content": "x", "status": 1}, "input.0.status", "Invalid type"),
    ({"type": "item_reference", "id": "msg_1"}, "input.0", "'function_call_output'"),
    ({"type": ["message"]}, "input.0", "'function_call_output'"),
    ("Hi", "input.0", "JSON object"),
    ({"type": "reasoning", "summary": []}, "input", "no message"),
])
def test_a_bad_input_item_is_refused_for_what_is_wrong_with_it(tool_server, item, param, words):
    # every item but a message was refused with "input.0.type: Input should be 'message'"; reasoning
    # alone with "List should have at least 1 item after validation, not 0"
    r = httpx.post(f"{tool_server.url}/v1/responses", json={"model": "tiny", "input": [item]}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tool_choice": {"type": "function", "name": "nowhere"}, "tools": [WEATHER]}, "tool_choice"),
    ({"truncation": "auto"}, "truncation"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_what_cannot_be_served_is_refused_by_name(tool_server, body, param):
    r = httpx.post(f"{tool_server.url}/v1/responses", json={"model": "tiny", "input": "Hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text
    tool_server.wait_idle()


def test_chat_messages_longer_than_the_context_are_refused_naming_messages(tool_server):
    # chat has no field "prompt", which the engine's check named
    r = httpx.post(f"{tool_server.url}/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "word " * 2100}], "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded", error


def test_input_longer_than_the_context_is_refused_naming_input(tool_server):
    # the chat path's check named its own field: param "prompt", which /v1/responses does not have
    r = httpx.post(f"{tool_server.url}/v1/responses", timeout=60,
                   json={"input": "word " * 2100, "max_output_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input" and error["code"] == "context_length_exceeded", error


@pytest.mark.parametrize("body, param, named", [
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format", "drop text.format"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "[a-z]+"}},
     "structured_outputs", "['text.format', 'structured_outputs']"),
], ids=["tool_choice", "two constraints"])
def test_a_refusal_from_chats_checks_names_the_responses_field_in_its_message_too(tool_server, body, param, named):
    # the param was renamed but the message said "drop response_format", a field /v1/responses has not got
    r = httpx.post(f"{tool_server.url}/v1/responses", json={"model": "tiny", "input": "Hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and named in error["message"], error
    assert "response_format" not in error["message"], error
