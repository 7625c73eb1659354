"""Bad requests get the right status and an OpenAI error object, and the server carries on unharmed."""

from __future__ import annotations

import threading

import httpx
import pytest

from nanoserve import SamplingParams
from tests.server.conftest import ServerProcess

KEY = "test-key-123"
CONTEXT = 64
OK = {"model": "tiny", "prompt": "A list is a sequence of", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
LONG = " ".join(["list dict class"] * 40)  # far over 64 tokens


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):
    with ServerProcess(server_model, tmp_path_factory.mktemp("bad-requests"), "--max-model-len", str(CONTEXT),
                       "--num-kvcache-blocks", "64", "--block-size", "16",
                       "--allowed-origins", "https://app.example", api_key=KEY) as proc:
        yield proc


def completion(**changes):
    body = {**OK, **changes}
    return {k: v for k, v in body.items() if v is not ...}


def chat(**changes):
    body = {**CHAT, **changes}
    return {k: v for k, v in body.items() if v is not ...}


# (name, path, json body or raw bytes, extra headers, status, param or None, words the message must hold)
CASES = [
    ("missing prompt", "/v1/completions", completion(prompt=...), {}, 400, "prompt", "Missing"),
    ("prompt is a number", "/v1/completions", completion(prompt=5), {}, 400, "prompt", "type"),
    ("empty prompt", "/v1/completions", completion(prompt=""), {}, 400, "prompt", "empty"),
    ("empty prompt list", "/v1/completions", completion(prompt=[]), {}, 400, "prompt", "empty"),
    ("mixed prompt list", "/v1/completions", completion(prompt=[1, "a"]), {}, 400, "prompt", "this array mixes them"),
    ("token id out of range", "/v1/completions", completion(prompt=[10**7]), {}, 400, "prompt", "out of range"),
    ("negative token id", "/v1/completions", completion(prompt=[-1]), {}, 400, "prompt", "out of range"),
    ("max_tokens as a string", "/v1/completions", completion(max_tokens="4"), {}, 400, "max_tokens", "integer"),
    ("max_tokens 0 without echo", "/v1/completions", completion(max_tokens=0), {}, 400, "max_tokens",
     "0 is allowed with echo"),
    ("max_tokens negative", "/v1/completions", completion(max_tokens=-5), {}, 400, "max_tokens",
     "greater than or equal to 0"),
    ("prompt plus max_tokens over the context", "/v1/completions", completion(max_tokens=CONTEXT), {}, 400,
     "max_tokens", "64"),
    ("prompt longer than the context", "/v1/completions", completion(prompt=LONG), {}, 400, "prompt", "64"),
    ("absurd max_tokens", "/v1/completions", completion(max_tokens=10**9), {}, 400, "max_tokens", "64"),
    ("max_tokens past int32", "/v1/completions", completion(max_tokens=2**31), {}, 400, "max_tokens",
     "less than or equal to 2147483647"),
    ("negative temperature", "/v1/completions", completion(temperature=-0.5), {}, 400, "temperature",
     "greater than or equal to 0"),
    ("temperature too high", "/v1/completions", completion(temperature=3), {}, 400, "temperature",
     "less than or equal to 2"),
    ("temperature as a word", "/v1/completions", completion(temperature="hot"), {}, 400, "temperature", "number"),
    ("temperature true", "/v1/completions", completion(temperature=True), {}, 400, "temperature",
     "Invalid type for 'temperature'"),
    ("top_p 0", "/v1/completions", completion(top_p=0), {}, 400, "top_p", "greater than 0"),
    ("top_p over 1", "/v1/completions", completion(top_p=1.5), {}, 400, "top_p", "less than or equal to 1"),
    ("top_k -2", "/v1/completions", completion(top_k=-2), {}, 400, "top_k", "greater than or equal to -1"),
    ("min_p 2", "/v1/completions", completion(min_p=2), {}, 400, "min_p", "less than or equal to 1"),
    ("presence_penalty 5", "/v1/completions", completion(presence_penalty=5), {}, 400, "presence_penalty",
     "less than or equal to 2"),
    ("frequency_penalty -3", "/v1/completions", completion(frequency_penalty=-3), {}, 400, "frequency_penalty",
     "greater than or equal to -2"),
    ("repetition_penalty 0", "/v1/completions", completion(repetition_penalty=0), {}, 400, "repetition_penalty",
     "greater than or equal to 0.01"),
    ("n 0", "/v1/completions", completion(n=0), {}, 400, "n", "greater than or equal to 1"),
    ("n too large", "/v1/completions", completion(n=1000), {}, 400, "n", "128"),
    # the union's first member blamed the valid text: "prompt.0: Input should be a valid integer"
    ("prompt mixing a text and token ids", "/v1/completions", completion(prompt=["a b", [5, 6, 7]]), {}, 400,
     "prompt", "this array mixes them"),
    ("logprobs too large", "/v1/completions", completion(logprobs=21), {}, 400, "logprobs", "20"),
    ("logprobs negative", "/v1/completions", completion(logprobs=-1), {}, 400, "logprobs",
     "greater than or equal to 0"),
    ("best_of over n", "/v1/completions", completion(best_of=3), {}, 400, "best_of", "best_of"),
    ("suffix", "/v1/completions", completion(suffix="end"), {}, 400, "suffix", "not supported"),
    ("truncate_prompt_tokens 0", "/v1/completions", completion(truncate_prompt_tokens=0), {}, 400,
     "truncate_prompt_tokens", "at least 1, or -1"),
    ("truncate_prompt_tokens -2", "/v1/completions", completion(truncate_prompt_tokens=-2), {}, 400,
     "truncate_prompt_tokens", "greater than or equal to -1"),
    ("logit_bias key not a token id", "/v1/completions", completion(logit_bias={"abc": 1}), {}, 400, "logit_bias",
     "token id"),
    ("logit_bias value out of range", "/v1/completions", completion(logit_bias={"5": 500}), {}, 400, "logit_bias",
     "100"),
    ("logit_bias token out of vocabulary", "/v1/completions", completion(logit_bias={"9999999": 1}), {}, 400,
     "logit_bias", "out of range"),
    ("stop as a number", "/v1/completions", completion(stop=123), {}, 400, "stop", "type"),
    ("stop_token_ids out of range", "/v1/completions", completion(stop_token_ids=[10**8]), {}, 400,
     "stop_token_ids", "out of range"),
    ("min_tokens over max_tokens", "/v1/completions", completion(min_tokens=10), {}, 400, "min_tokens",
     "min_tokens (10) must be <= max_tokens (4)"),
    ("seed as a string", "/v1/completions", completion(seed="abc"), {}, 400, "seed", "integer"),
    ("stream as a string", "/v1/completions", completion(stream="yes"), {}, 400, "stream", "boolean"),
    ("stream_options without stream", "/v1/completions", completion(stream_options={"include_usage": True}), {},
     400, "stream_options", "stream"),
    ("unknown field", "/v1/completions", completion(frobnicate=1), {}, 400, "frobnicate", "Unrecognized"),
    # the request's own key, however it looks: capitals and type names marked union members
    ("unknown field named like a class", "/v1/completions", completion(Temperature=1), {}, 400, "Temperature",
     "Unrecognized request argument supplied: Temperature"),
    ("unknown field named like a type", "/v1/completions", completion(str=1), {}, 400, "str",
     "Unrecognized request argument supplied: str"),
    ("unknown nested field named like a class", "/v1/completions",
     completion(stream=True, stream_options={"Include_usage": True}), {}, 400, "stream_options.Include_usage",
     "Unrecognized request argument supplied: stream_options.Include_usage"),
    ("not JSON", "/v1/completions", b'{"prompt": "x", ', {}, 400, None, "JSON"),
    ("a JSON array", "/v1/completions", b"[1, 2]", {}, 400, None, "object"),
    ("a lone surrogate escape", "/tokenize", b'{"prompt": "\\ud800"}', {}, 400, None, "UTF-16 surrogate"),
    ("a lone low surrogate escape", "/v1/completions", b'{"prompt": "\\udc00"}', {}, 400, None, "UTF-16 surrogate"),
    ("invalid UTF-8 bytes", "/v1/completions", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}', {}, 400, None, "JSON"),
    ("NaN temperature", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', {}, 400, "temperature",
     "finite number"),
    ("empty body", "/v1/completions", b"", {}, 400, None, "JSON"),
    ("wrong content type", "/v1/completions", b"prompt=x", {"Content-Type": "application/x-www-form-urlencoded"},
     400, None, "Content-Type"),
    ("unknown model", "/v1/completions", completion(model="gpt-9"), {}, 404, "model", "gpt-9"),
    ("unknown route", "/v1/nothing", completion(), {}, 404, None, "no such route"),
    ("missing key", "/v1/completions", completion(), {"Authorization": ""}, 401, None, "API key"),
    ("wrong key", "/v1/completions", completion(), {"Authorization": "Bearer nope"}, 401, None, "API key"),
    ("key without Bearer", "/v1/models", None, {"Authorization": KEY}, 401, None, "API key"),
    ("missing messages", "/v1/chat/completions", chat(messages=...), {}, 400, "messages", "Missing"),
    ("empty messages", "/v1/chat/completions", chat(messages=[]), {}, 400, "messages", "at least 1 item"),
    ("unknown role", "/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), {}, 400,
     "messages.0.role", "'system', 'developer', 'user', 'assistant' or 'tool'"),
    ("content is a number", "/v1/chat/completions", chat(messages=[{"role": "user", "content": 3}]), {}, 400,
     "messages.0.content", "Invalid type for 'messages.0.content'"),
    ("image content", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), {}, 400,
     "messages.0.content.0.type", "'image_url' is not supported: this server's model reads text only"),
    ("audio content", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio",
                                                   "input_audio": {"data": "UklG", "format": "wav"}}]}]), {}, 400,
     "messages.0.content.1.type", "'input_audio' is not supported"),
    # of a union's members, the one that got furthest names the problem
    ("a text part with an unknown key", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}]), {}, 400,
     "messages.0.content.0.cache_control", "Unrecognized request argument"),
    ("a named tool_choice without its function", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function"}), {}, 400,
     "tool_choice.function", "Missing required parameter"),
    ("top_logprobs without logprobs", "/v1/chat/completions", chat(top_logprobs=2), {}, 400, "top_logprobs",
     "logprobs"),
    ("top_logprobs too large", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21), {}, 400,
     "top_logprobs", "20"),
    ("a request's own chat template", "/v1/chat/completions", chat(chat_template="{{ messages }}"), {}, 400,
     "chat_template", "--chat-template"),
    ("prompt_logprobs past the logprobs limit", "/v1/completions", completion(prompt_logprobs=21), {}, 400,
     "prompt_logprobs", "20"),
    ("max_completion_tokens past the context", "/v1/chat/completions",
     chat(max_tokens=..., max_completion_tokens=100000), {}, 400, "max_completion_tokens", "maximum context length"),
    ("tool without a function", "/v1/chat/completions", chat(tools=[{"type": "function"}]), {}, 400,
     "tools.0.function", "Missing"),
    ("functions (the old API)", "/v1/chat/completions", chat(functions=[{"name": "f"}]), {}, 400, "functions",
     "not supported"),
    ("chat over the context", "/v1/chat/completions", chat(messages=[{"role": "user", "content": LONG}]), {}, 400,
     "messages", "64"),
    ("tokenize with prompt and messages", "/tokenize", {"prompt": "x", "messages": CHAT["messages"]}, {}, 400,
     "prompt", "exactly one"),
    ("detokenize out of range", "/detokenize", {"tokens": [10**7]}, {}, 400, "tokens", "out of range"),
    ("min_tokens past the default max_tokens", "/v1/completions", completion(min_tokens=20, max_tokens=...), {}, 400,
     "min_tokens", "max_tokens is not given"),
    ("detokenize past the context", "/detokenize", {"tokens": [5] * 65}, {}, 400, "tokens", "max_model_len"),
    ("two tools of one name", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2, tool_choice="required"), {}, 400, "tools",
     "'f'"),
    ("a compressed body", "/v1/completions", {"prompt": "x"}, {"Content-Encoding": "gzip"}, 400, None,
     "Content-Encoding"),
    # a member that must be an object names itself, not the body (which is one)
    ("a message that is null", "/v1/chat/completions", chat(messages=[None]), {}, 400, "messages.0",
     "Invalid type for 'messages.0': expected a JSON object"),
    ("a content part that is a string", "/v1/chat/completions", chat(messages=[{"role": "user", "content": ["hi"]}]),
     {}, 400, "messages.0.content.0", "Invalid type for 'messages.0.content.0': expected a JSON object"),
]


def send(server: ServerProcess, path: str, body, headers: dict) -> httpx.Response:
    all_headers = {**server.headers, **headers}
    if body is None:
        return httpx.get(server.url + path, headers=all_headers, timeout=30)
    if isinstance(body, bytes):
        all_headers.setdefault("Content-Type", "application/json")
        return httpx.post(server.url + path, content=body, headers=all_headers, timeout=30)
    return httpx.post(server.url + path, json=body, headers=all_headers, timeout=30)


def test_there_are_at_least_30_cases_and_each_names_its_message():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)
    # an empty expected message is in every message: such a case would check nothing
    assert [c[0] for c in CASES if not c[-1].strip()] == []


@pytest.mark.parametrize("name, path, body, headers, status, param, words", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_status_and_error_object(server, name, path, body, headers, status, param, words):
    r = send(server, path, body, headers)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and words in error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", completion(**{"frobnicate" * 100_000: 1})),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "hi", "x" * 1_000_000: 1}])),
])
def test_an_unknown_field_with_a_huge_name_is_named_cut(server, path, body):
    # the key came back whole twice, in the message and in param: 10 MB of error for a 5 MB key
    r = send(server, path, body, {})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert len(r.content) < 1024
    assert error["code"] == "unrecognized_argument"
    assert error["param"] and error["param"] in error["message"]


def test_context_error_names_both_numbers(server):
    r = send(server, "/v1/completions", completion(max_tokens=60), {})
    prompt_len = len(httpx.post(f"{server.url}/tokenize", json={"prompt": OK["prompt"]},
                                headers=server.headers).json()["tokens"])
    assert prompt_len + 60 > CONTEXT
    assert f"{prompt_len + 60} were requested ({prompt_len} in the prompt and 60 for the completion)" in \
        r.json()["error"]["message"]
    assert "maximum context length is 64 tokens" in r.json()["error"]["message"]


def test_health_is_open_and_everything_else_needs_the_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    # vLLM's /ping, the probe of SageMaker-style hosts, by GET or POST
    assert httpx.get(f"{server.url}/ping").status_code == httpx.post(f"{server.url}/ping").status_code == 200
    assert httpx.head(f"{server.url}/health").status_code == 200   # probes that ask with HEAD
    assert httpx.get(f"{server.url}/health/", follow_redirects=True).status_code == 200
    for path in ("/v1/models", "/metrics", "/version"):
        assert httpx.get(server.url + path).status_code == 401
        assert httpx.get(server.url + path, headers=server.headers).status_code == 200
        # the scheme's case is free (RFC 7235); a stray space is no reason to refuse
        for header in (f"bearer {KEY}", f"BEARER  {KEY}", f"Bearer \t{KEY}"):
            assert httpx.get(server.url + path, headers={"Authorization": header}).status_code == 200, header
        for header in (f"Basic {KEY}", f"Bearer {KEY}x", "Bearer", f"{KEY}"):
            assert httpx.get(server.url + path, headers={"Authorization": header}).status_code == 401, header


@pytest.mark.parametrize("key", ["", "   ", "sékret"])
def test_an_empty_or_non_ascii_api_key_stops_serve_before_it_starts(key):
    from tests.server.test_cli import run_cli

    result = run_cli("serve", "--api-key", key, "--port", "1", timeout=60)
    assert result.returncode != 0 and "--api-key" in result.stderr, result.stderr[-500:]


def test_method_not_allowed_is_an_error_object(server):
    r = httpx.get(f"{server.url}/v1/completions", headers=server.headers)
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_after_every_bad_request_the_server_still_serves_correctly(server, offline):
    # a stream runs while a second pass of bad requests goes in: it must not notice them
    streamed: list[str] = []

    def run_stream():
        with httpx.stream("POST", f"{server.url}/v1/completions", headers=server.headers, timeout=120,
                          json={**OK, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            streamed.extend(line for line in r.iter_lines() if line.startswith("data: "))

    thread = threading.Thread(target=run_stream)
    thread.start()
    for name, path, body, headers, status, *_ in CASES:
        assert send(server, path, body, headers).status_code == status, name
    thread.join(120)
    assert streamed[-1] == "data: [DONE]" and len(streamed) > 2

    ref = offline.generate(OK["prompt"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=60,
                   json={**OK, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text
    server.wait_idle()  # and no request left a KV block behind


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(server):
    body = {"messages": [{"role": "user", "content": "A list"}], "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=120).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == CONTEXT


def test_cors_answers_allowed_origins_only_and_preflights_need_no_key(server):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(f"{server.url}/v1/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(f"{server.url}/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{server.url}/v1/models", headers={**server.headers, "Origin": "https://app.example"})
    assert r.headers["access-control-allow-origin"] == "https://app.example"

