"""Chat requests that carry tools, tool history and template arguments, against a real server
(conftest's tool_server: Qwen3's template, hermes tool calls): what reaches the template, and the 400s for what
cannot be honoured or would be unbounded before tokenizing."""

from __future__ import annotations

import httpx
import pytest

from tests.server.test_tool_calling import MESSAGES, TOOLS


def test_chat_template_kwargs_and_tool_history_reach_the_template(tool_server):
    def tokenize(body: dict) -> str:
        r = httpx.post(f"{tool_server.url}/tokenize", json={"model": "tiny", **body}, timeout=30)
        assert r.status_code == 200, r.text
        return httpx.post(f"{tool_server.url}/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30)\
            .json()["prompt"]
    off = tokenize({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # OpenAI's developer role is its system role: Qwen3's template has no header of that name
    developer = tokenize({"messages": [{"role": "developer", "content": "Be brief."}, *MESSAGES]})
    assert "<|im_start|>system\nBe brief." in developer and "developer" not in developer
    assert not tokenize({"messages": MESSAGES}).endswith("</think>\n\n")
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "GetWeather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    text = tokenize({"messages": history, "tools": TOOLS})
    assert '<tool_call>\n{"name": "GetWeather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert "<tool_response>\n21 degrees\n</tool_response>" in text and '"name": "Add"' in text
    # an assistant turn's reasoning, under vLLM's name or the older one, reaches the template
    # (Qwen3's writes it back for the turns after the last user message)
    for name in ("reasoning", "reasoning_content"):
        turn = {**history[1], name: "the user wants Paris"}
        assert "<think>\nthe user wants Paris\n</think>" in tokenize({"messages": [history[0], turn, history[2]],
                                                                        "tools": TOOLS})
    assert "the user wants Paris" not in text


@pytest.mark.parametrize("depth", [50_000, 950])
def test_tool_call_arguments_in_history_nest_no_deeper_than_a_body_may(tool_server, depth):
    # the template reads them as JSON: 50,000 levels broke json.loads, 950 the template's tojson (500s)
    arguments = "[" * depth + "]" * depth
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "Add", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    for path, extra in (("/v1/chat/completions", {"max_tokens": 4}), ("/tokenize", {})):
        r = httpx.post(f"{tool_server.url}{path}", json={"messages": history, "tools": TOOLS, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages.1.tool_calls.0.function.arguments" and "levels deep" in error["message"]
    ok = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "Add", "arguments": "[" * 200 + "]" * 200}}]}
    r = httpx.post(f"{tool_server.url}/v1/chat/completions",
                   json={"messages": [*MESSAGES, ok, history[2]], "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text


def test_tool_call_arguments_in_history_that_escape_a_lone_surrogate_are_rendered_as_written(tool_server):
    # json.loads reads the arguments' "\\ud800" as a lone surrogate, which no text holds: the template
    # wrote it and the tokenizer raised (a 500), then such history was refused, though the JSON grammar
    # lets a model write the escape in its own call, which the client sends back
    def history(arguments: str) -> list[dict]:
        return MESSAGES + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "GetWeather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]

    def responses_input(arguments: str) -> list[dict]:
        return [*MESSAGES, {"type": "function_call", "call_id": "call_1", "name": "GetWeather", "arguments": arguments},
                {"type": "function_call_output", "call_id": "call_1", "output": "21 degrees"}]

    for arguments in ('{"city": "\\ud800"}', '{"\\udfff": 1}', '"Paris\\udc00"'):
        for path, body in (("/v1/chat/completions", {"messages": history(arguments), "max_tokens": 4}),
                           ("/v1/chat/completions", {"messages": history(arguments), "max_tokens": 4, "stream": True}),
                           ("/v1/responses", {"input": responses_input(arguments), "max_output_tokens": 4})):
            r = httpx.post(f"{tool_server.url}{path}", json={"model": "tiny", **body}, timeout=60)
            assert r.status_code == 200, (path, arguments, r.text)
            assert '"error":{' not in r.text.replace(" ", ""), (path, arguments, r.text[-300:])
        r = httpx.post(f"{tool_server.url}/tokenize", json={"model": "tiny", "messages": history(arguments),
                                                            "return_token_strs": True}, timeout=60)
        assert r.status_code == 200, r.text
        prompt = httpx.post(f"{tool_server.url}/detokenize", json={"model": "tiny", "tokens": r.json()["tokens"]},
                            timeout=60).json()["prompt"]
        assert arguments in prompt   # the escape as written, where the model's call stood
    # a whole pair is a character, and an escaped backslash no escape at all
    for arguments in ('{"city": "\\ud83d\\ude00"}', '{"city": "\\\\ud800"}'):
        r = httpx.post(f"{tool_server.url}/v1/chat/completions", timeout=60,
                       json={"messages": history(arguments), "tools": TOOLS, "max_tokens": 4})
        assert r.status_code == 200, r.text


BIG_TOOLS = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
    "type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(7000)}}}} for i in range(2)]


@pytest.mark.parametrize("body, words", [
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    # any structured-output field, not response_format alone: the call's grammar would take its place
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "zzz"}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "Add"}},
      "structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    # apply_chat_template's own arguments: each was a 500, or silently did nothing
    ({"chat_template_kwargs": {"return_assistant_tokens_mask": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"sanitize_control_tokens": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"truncation": True, "max_length": 3}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs"),   # was blamed on 'messages'
    # the grammar that enforces the call is built from the tools' schemas: past the spec limit it was a 500
    ({"tools": BIG_TOOLS, "tool_choice": "required"}, "characters long"),
    ({"tools": BIG_TOOLS, "tool_choice": {"type": "function", "function": {"name": "f0"}}}, "characters long"),
    # arguments are an object: a string schema was enforced, and the call came back incomplete
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "the JSON schema of an object"),
])
def test_tool_requests_it_cannot_honour_are_400s(tool_server, body, words):
    r = httpx.post(f"{tool_server.url}/v1/chat/completions",
                   json={"messages": MESSAGES, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_a_conversation_of_more_messages_than_the_context_holds_is_refused_before_rendering(tool_server):
    limit = httpx.post(f"{tool_server.url}/tokenize", json={"prompt": "x"}, timeout=30).json()["max_model_len"]
    messages = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}] * (limit // 2 + 1)
    for path, extra in (("/v1/chat/completions", {"max_tokens": 4}), ("/tokenize", {})):
        r = httpx.post(f"{tool_server.url}{path}", json={"messages": messages, **extra}, timeout=60)
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{tool_server.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("where", ["tool description", "reasoning_content"])
def test_text_only_the_template_writes_is_bounded_before_tokenizing(tool_server, where):
    # the template writes tools and reasoning_content; 25 MB of either took 40 s and 3.6 GB to tokenize
    big = "word " * 200_000
    body = {"messages": [*MESSAGES, {"role": "assistant", "content": "x", "reasoning_content": big}]} \
        if where == "reasoning_content" else \
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f", "description": big}}]}
    for path, extra in (("/v1/chat/completions", {"max_tokens": 4}), ("/tokenize", {})):
        r = httpx.post(f"{tool_server.url}{path}", json={**body, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and "as the chat template writes it" in error["message"]


def test_responses_refuses_a_function_whose_parameters_are_no_object(tool_server):
    r = httpx.post(f"{tool_server.url}/v1/responses", timeout=30, json={
        "input": "x", "max_output_tokens": 4, "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.parameters", r.text
