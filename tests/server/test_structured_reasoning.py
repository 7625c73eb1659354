"""Structured outputs after the reasoning (`--reasoning-parser qwen3`): the grammar of a
response_format or a required tool waits for `</think>`, as vLLM's does, so a reasoning model thinks
first and answers to the grammar, in `content` or `tool_calls`.

The bundled tokenizer writes `<think>` in four tokens; this model folder's tokenizer has them as
single tokens (two rare merges give up their ids), as Qwen3's has. A logit bias stands in for a
model that closes its reasoning."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from nanoserve.server.chat import single_token_id
from tests.server.conftest import QWEN3_TEMPLATE, ServerProcess, openai_client

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}
TAGS = ("<think>", "</think>")


def with_reasoning_tokens(model: str, folder) -> str:
    """A copy of the model whose tokenizer has <think> and </think> as tokens of their own."""
    for name in os.listdir(model):
        source = os.path.join(model, name)
        if name == "tokenizer.json":
            continue
        os.symlink(source, folder / name) if name.endswith(".safetensors") else shutil.copy(source, folder / name)
    with open(os.path.join(model, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab, merges = tok["model"]["vocab"], tok["model"]["merges"]
    for tag, (left, right) in zip(TAGS, merges[-2:]):   # the last merges make tokens that no later merge uses
        token_id = vocab.pop(left + right)
        vocab[tag] = token_id
        tok["added_tokens"].append({"id": token_id, "content": tag, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    del merges[-2:]
    with open(folder / "tokenizer.json", "w") as f:
        json.dump(tok, f, ensure_ascii=False)
    return str(folder)


@pytest.fixture(scope="module")
def thinker(server_model, tmp_path_factory):
    model = with_reasoning_tokens(server_model, tmp_path_factory.mktemp("thinking-model"))
    with ServerProcess(model, tmp_path_factory.mktemp("thinker"), "--num-kvcache-blocks", "256", "--block-size", "16",
                       "--chat-template", str(QWEN3_TEMPLATE), "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3") as proc:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model)
        proc.think_ids = [single_token_id(tokenizer, tag) for tag in TAGS]
        assert None not in proc.think_ids
        yield proc


def opened_reasoning(**fields) -> dict:
    """A request whose prompt opens the reasoning (as thinking templates do); the bias closes it."""
    return dict(messages=[{"role": "user", "content": "Count something."},
                          {"role": "assistant", "content": "<think>\n"}],
                extra_body={"continue_final_message": True, "add_generation_prompt": False}, **fields)


def test_a_response_format_holds_after_the_reasoning_ends(thinker):
    client = openai_client(thinker.url)
    end = thinker.think_ids[1]
    for stream in (False, True):
        kwargs = opened_reasoning(model="tiny", temperature=0, max_tokens=40, logit_bias={str(end): 100},
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "count", "schema": SCHEMA}})
        if stream:
            content, reasoning = "", ""
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                delta = chunk.choices[0].delta if chunk.choices else None
                content += (delta.content or "") if delta else ""
                reasoning += (getattr(delta, "reasoning_content", None) or "") if delta else ""
        else:
            message = client.chat.completions.create(**kwargs).choices[0].message
            content, reasoning = message.content, getattr(message, "reasoning_content", None) or ""
        # the reasoning ended at once (the bias), and the answer is the schema's JSON, not more reasoning
        assert reasoning.strip() == ""
        assert isinstance(json.loads(content)["n"], int), content


def test_a_required_tool_is_called_after_the_reasoning(thinker):
    client = openai_client(thinker.url)
    end = thinker.think_ids[1]
    tools = [{"type": "function", "function": {"name": "count", "parameters": SCHEMA}}]
    choice = client.chat.completions.create(**opened_reasoning(
        model="tiny", temperature=0, max_tokens=300, logit_bias={str(end): 100}, tools=tools,
        tool_choice="required", parallel_tool_calls=False)).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "count" and isinstance(json.loads(call.function.arguments)["n"], int)


def test_the_model_may_reason_before_the_grammar_holds(thinker):
    """Its first token may open the reasoning (the standard template leaves that to the model);
    inside it, any token may come: here <think> again and again, under the bias."""
    client = openai_client(thinker.url)
    start = thinker.think_ids[0]
    choice = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count something."}], temperature=0, max_tokens=8,
        logit_bias={str(start): 100}, response_format={"type": "json_object"}).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.reasoning_content == "<think>" * 7


def test_a_reasoning_the_template_closed_holds_the_grammar_from_the_first_token(thinker):
    """enable_thinking false: the template writes an empty think block, so the answer starts at
    once, under the grammar; <think> may not reopen it (the bias pushed it before)."""
    client = openai_client(thinker.url)
    start = thinker.think_ids[0]
    choice = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count something."}], temperature=0, max_tokens=40,
        logit_bias={str(start): 100}, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True}).choices[0]
    assert start not in choice.token_ids
    assert isinstance(json.loads(choice.message.content)["n"], int)


def test_a_long_reasoning_the_prompt_opened_is_continued_free(thinker):
    """The <think> of a continued message may lie far back: the output still starts inside the
    reasoning (the end token, pushed by the bias, comes first), and the answer follows the grammar."""
    client = openai_client(thinker.url)
    end = thinker.think_ids[1]
    prefill = "<think>\n" + " ".join(["apples"] * 40)
    choice = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count something."},
                                {"role": "assistant", "content": prefill}],
        temperature=0, max_tokens=40, logit_bias={str(end): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "return_token_ids": True}).choices[0]
    assert choice.token_ids[0] == end
    assert isinstance(json.loads(choice.message.content)["n"], int)
