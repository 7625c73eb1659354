"""What real clients send: nulls for every optional field, OpenAI's bookkeeping fields, no max_tokens."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from nanoserve import SamplingParams
from nanoserve.server.conversation import template_inputs
from nanoserve.generation_defaults import sampling_defaults
from nanoserve.server.chat_protocol import ChatCompletionRequest, ChatMessage
from nanoserve.server.protocol import CompletionRequest
from tests.server.conftest import openai_client

PROMPT = "A list is"
MESSAGES = [{"role": "user", "content": "What is a dict?"}]
BOOKKEEPING = {"metadata": {"team": "a"}, "store": False, "service_tier": "auto", "prompt_cache_key": "k1",
               "prompt_cache_retention": "24h", "safety_identifier": "user-7", "user": "u"}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server.url, timeout=120)


def test_openai_client_passing_none_everywhere_gets_the_defaults(client, offline):
    ref = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, n=None, stream=None,
                                      echo=None, logprobs=None, stop=None, seed=None, top_p=None, user=None,
                                      presence_penalty=None, frequency_penalty=None, logit_bias=None,
                                      best_of=None, suffix=None, stream_options=None)
    assert whole.choices[0].text == ref.text and len(whole.choices) == 1
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, n=None,
                                          stream=None, logprobs=None, top_logprobs=None, tools=None,
                                          tool_choice=None, response_format=None, parallel_tool_calls=None,
                                          max_completion_tokens=None, seed=None, stop=None, metadata=None)
    assert chat.choices[0].message.content and chat.choices[0].logprobs is None


def test_raw_json_nulls_are_the_defaults(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "n": None, "stream": None, "echo": None, "ignore_eos": None,
            "min_tokens": None, "skip_special_tokens": None, "include_stop_str_in_output": None, "top_k": None}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    # a required field is still required: null names it
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": None}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_bookkeeping_fields_are_accepted_and_change_nothing(client, offline):
    ref = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, extra_body=BOOKKEEPING)
    assert out.choices[0].text == ref.text
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                          **BOOKKEEPING)
    assert chat.choices[0].finish_reason == "length"
    # the default values of output-changing fields are no change: accepted
    same = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, suffix="")
    assert same.choices[0].text == ref.text
    text_only = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                               modalities=["text"])
    assert text_only.choices[0].message.content == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="modalities"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, modalities=["text", "audio"])
    with pytest.raises(openai.BadRequestError, match="prompt_cache_retention"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, prompt_cache_retention="1y")


@pytest.mark.parametrize("obfuscation", [True, False])
def test_stream_options_include_obfuscation_is_accepted_and_changes_nothing(client, offline, obfuscation):
    ref = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    options = {"include_usage": True, "include_obfuscation": obfuscation}
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options=options))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == 6
    chat = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                               stream=True, stream_options=options))
    assert chat[-1].usage.completion_tokens == 6 and chat[-2].choices[0].finish_reason == "length"


def test_completion_without_max_tokens_generates_16_tokens(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_tokenizer_info_serves_the_tokenizer_config(server):
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=10).json()
    assert info["tokenizer_class"] and info["eos_token"] == "<|endoftext|>"
    assert "<|im_start|>" in info["chat_template"] and info["model_max_length"] == 2048


def test_message_name_reaches_the_chat_template(offline):
    conversation, extra = template_inputs([ChatMessage(role="user", content="hi", name="alice"),
                                           ChatMessage(role="user", content="x")], None, None)
    text = offline.tokenizer.apply_chat_template(
        conversation, tokenize=False, **extra,
        chat_template="{% for m in messages %}[{{ m.name or '-' }}] {{ m.content }}\n{% endfor %}")
    assert text == "[alice] hi\n[-] x\n"


def test_generation_config_supplies_defaults_the_request_can_override(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 9}))
    defaults = sampling_defaults(str(tmp_path), "auto")
    # max_new_tokens caps max_tokens, as vLLM reads it (test_vllm_flags.py)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 9}
    assert sampling_defaults(str(tmp_path), "vllm") == {}
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "top_p": 0.5})
    params = req.sampling_params(None, None, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.6, 0.5, 20, 1.1)
    assert CompletionRequest.model_validate({"prompt": "x"}).sampling_params(4, None, {}).temperature == 1.0
    with pytest.raises(ValueError, match="generation-config"):
        sampling_defaults(str(tmp_path), "nonsense")


def test_bundled_generation_config_sets_no_max_new_tokens():
    from nanoserve.config import DEFAULT_MODEL
    with open(f"{DEFAULT_MODEL}/generation_config.json") as f:
        assert "max_new_tokens" not in json.load(f)


def test_logit_bias_keys_with_leading_zeros_name_their_token():
    req = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"00000000005": 2.0, "0": -1.0}})
    assert req.sampling_params(4, None, {}).logit_bias == {5: 2.0, 0: -1.0}


def test_max_completion_tokens_wins_over_max_tokens_as_in_vllm(client):
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=9, max_completion_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"


def test_an_empty_or_identity_content_encoding_is_no_encoding(server):
    for encoding in ("", "identity", "Identity"):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                       headers={"Content-Encoding": encoding}, timeout=60)
        assert r.status_code == 200, (encoding, r.text)


def test_vllm_add_special_tokens_and_priority_are_served_as_vllm_serves_them(client, server):
    # add_special_tokens: on by default for a text prompt, off for chat (the template writes them)
    for special in (True, False):
        counted = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT, "add_special_tokens": special},
                             timeout=60).json()["count"]
        done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                         extra_body={"add_special_tokens": special, "priority": 0})
        assert done.usage.prompt_tokens == counted
        chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                              extra_body={"add_special_tokens": special, "priority": 0,
                                                          "ignore_eos": True})
        assert chat.choices[0].finish_reason == "length"
    # priority other than 0 needs a priority scheduler, which this server (like vLLM by default) lacks
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 2, "priority": 5}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    server.wait_idle()


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": PROMPT}),
                                        ("/v1/chat/completions", {"messages": MESSAGES})])
def test_stream_options_that_ask_for_nothing_are_accepted_without_stream(server, path, body):
    # as vLLM takes them: {} (or nulls) asks for nothing; a set option still needs a stream
    for options in ({}, {"include_usage": None}):
        r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 2, "stream_options": options}, timeout=60)
        assert r.status_code == 200, r.text
        assert "usage" in r.json()
    r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 2, "stream_options": {"include_usage": False}},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


@pytest.mark.parametrize("metadata, named", [
    ({f"k{i}": "v" for i in range(17)}, "metadata"),     # OpenAI's bounds: 16 pairs,
    ({"k" * 65: "v"}, "metadata"),                        # keys of 64 characters,
    ({"k": "v" * 513}, "metadata.k"),                     # string values of 512
    ({"k": 1}, "metadata.k"),
])
def test_metadata_past_openais_bounds_is_a_400_naming_it(server, metadata, named):
    # unbounded, 10 MB of metadata came back three times in a Responses stream
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/responses", {"input": PROMPT})):
        r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 2, "metadata": metadata}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(named), (path, r.text[:300])
    largest = {f"k{i}": "v" * 512 for i in range(16)}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "metadata": largest},
                   timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field, bound", [("safety_identifier", 64), ("prompt_cache_key", 512), ("user", 512)])
def test_an_identifier_past_its_bound_is_a_400_naming_it(server, field, bound):
    # each came back three times in a Responses stream: 10 MB of it made a 30 MB stream
    for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
                       ("/v1/responses", {"input": PROMPT, "max_output_tokens": 2, "stream": True})):
        r = httpx.post(f"{server.url}{path}", json={**body, field: "u" * (bound + 1)}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, r.text[:300])
        r = httpx.post(f"{server.url}{path}", json={**body, field: "u" * bound}, timeout=30)
        assert r.status_code == 200, (path, r.text[:300])
