"""Chat messages as vLLM reads them and chat answers as OpenAI shapes them, on the session's server."""

from __future__ import annotations

import json

import httpx
import pytest


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def prompt_ids(http: httpx.Client, messages: list[dict]) -> list[int]:
    r = http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them(http):
    # two parts, e.g. a document and a question: joined with nothing, their words ran together
    parts = [{"type": "text", "text": "A list holds items."}, {"type": "text", "text": "What is a dict?"}]
    joined = [{"role": "user", "content": "A list holds items.\nWhat is a dict?"}]
    assert prompt_ids(http, [{"role": "user", "content": parts}]) == prompt_ids(http, joined)
    body = {"max_tokens": 1, "temperature": 0}
    with_parts = http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": parts}]})
    assert with_parts.json()["usage"]["prompt_tokens"] == len(prompt_ids(http, joined))


def test_responses_api_text_parts_are_read_as_text_parts_as_vllm_reads_them(http):
    # clients that speak both APIs send "input_text" / "output_text" parts in chat history too
    history = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Hello.", "annotations": [],
                                                  "logprobs": []}]},
               {"role": "user", "content": [{"type": "text", "text": "why?"}]}]
    as_text = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "why?"}]
    assert prompt_ids(http, history) == prompt_ids(http, as_text)
    reply = http.post("/v1/chat/completions", json={"messages": history, "max_tokens": 1})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(prompt_ids(http, as_text))
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]
    refused = http.post("/v1/chat/completions", json={"messages": image, "max_tokens": 1})
    assert refused.status_code == 400 and "input_image" in refused.json()["error"]["message"]


def test_an_assistant_refusal_part_in_history_is_read_as_its_text(http):
    # OpenAI's API replays a refusal as a content part of type "refusal"; vLLM reads it as text
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot help."}]},
               {"role": "user", "content": "why?"}]
    as_text = [history[0], {"role": "assistant", "content": "I cannot help."}, history[2]]
    assert prompt_ids(http, history) == prompt_ids(http, as_text)
    reply = http.post("/v1/chat/completions", json={"messages": history, "max_tokens": 1})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(prompt_ids(http, as_text))


def test_an_assistant_message_replayed_from_openai_with_its_refusal_field_is_read(http):
    # the client's own ChatCompletionMessage, replayed as the history: a refusal comes in the message's
    # `refusal` field, content null; it was refused as "Unrecognized request argument: messages.1.refusal"
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "refusal": "I cannot help.", "annotations": [],
                "audio": None, "function_call": None, "tool_calls": None},
               {"role": "user", "content": "why?"}]
    as_text = [history[0], {"role": "assistant", "content": "I cannot help."}, history[2]]
    assert prompt_ids(http, history) == prompt_ids(http, as_text)
    reply = http.post("/v1/chat/completions", json={"messages": history, "max_tokens": 1, "verbosity": "low"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == len(prompt_ids(http, as_text))


def test_an_empty_answer_is_empty_content_whole_and_streamed(http):
    # the stream opens with content "" and adds nothing: the whole message said null
    (eos,) = http.post("/tokenize", json={"prompt": "<|im_end|>", "add_special_tokens": False}).json()["tokens"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logit_bias": {str(eos): 100}}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["finish_reason"] == "stop" and whole["message"]["content"] == ""
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ""


def test_continue_final_message_extends_the_assistant_message_as_vllm_does(http):
    # vLLM's prefill of the reply: the last message is left open and the model writes on from it
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A list"}]
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    chat = http.post("/v1/chat/completions", json={**body, "messages": messages, "add_generation_prompt": False,
                                                   "continue_final_message": True}).json()
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nA list"
    completion = http.post("/v1/completions", json={**body, "prompt": text}).json()
    assert chat["usage"]["prompt_tokens"] == completion["usage"]["prompt_tokens"]
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    # without the generation prompt the template's text ends after the last message
    closed = http.post("/v1/chat/completions", json={**body, "messages": messages, "add_generation_prompt": False})
    assert closed.json()["usage"]["prompt_tokens"] == len(http.post("/tokenize", json={
        "messages": messages, "add_generation_prompt": False}).json()["tokens"])
    both = http.post("/v1/chat/completions", json={**body, "messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_a_model_chat_template_that_does_not_compile_is_the_servers_fault_not_the_clients(server_model, caplog):
    # it answered every chat request with a 400 saying the template refused the request's messages
    from tests.server.conftest import serving, tiny_engine

    engine = tiny_engine(server_model)
    engine.tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}"   # no endfor
    with caplog.at_level("ERROR", logger="nanoserve.server.state"), serving(engine) as (url, _):
        assert any("chat template does not compile" in r.getMessage() for r in caplog.records)
        messages = [{"role": "user", "content": "Hi"}]
        for path, body in (("/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
                           ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
                           ("/tokenize", {"messages": messages})):
            r = httpx.post(f"{url}{path}", json=body, timeout=60)
            assert r.status_code == 500, (path, r.text)
            assert r.json()["error"]["code"] == "chat_template_error" and "--chat-template" in r.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60).status_code == 200
