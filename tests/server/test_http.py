"""Raw HTTP: SSE framing and the exact JSON shape of every endpoint."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from nanoserve import SamplingParams
from nanoserve.server.logprobs import TokenTexts
from tests.server.conftest import serving, tiny_engine

COMPLETION_KEYS = {"id", "object", "created", "model", "choices", "usage"}
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def sse_events(response: httpx.Response) -> list[str]:
    """The data of each event, checking the framing on the way: `data: ...` then a blank line."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1]), raw
    return [e[len("data: "):] for e in events[:-1]]


def stream(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        data = sse_events(response)
    assert data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    return [json.loads(d) for d in data[:-1]]


def test_completion_stream_framing_and_usage_chunk(http):
    body = {"model": "tiny", "prompt": "A dict maps", "max_tokens": 7, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    chunks = stream(http, "/v1/completions", body)
    for chunk in chunks:
        assert set(chunk) == COMPLETION_KEYS
        assert chunk["object"] == "text_completion" and chunk["model"] == "tiny"
        assert chunk["id"] == chunks[0]["id"] and chunk["id"].startswith("cmpl-")
    *text_chunks, last = chunks
    assert last["choices"] == [] and set(last["usage"]) == USAGE_KEYS
    assert last["usage"]["completion_tokens"] == 7
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 7
    for chunk in text_chunks:
        assert chunk["usage"] is None
        (choice,) = chunk["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    whole = http.post("/v1/completions", json={**body, "stream_options": None}).json()
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole["choices"][0]["text"]


def test_stream_without_include_usage_has_no_usage_key(http):
    chunks = stream(http, "/v1/completions", {"prompt": "A dict maps", "max_tokens": 3})
    assert all("usage" not in c for c in chunks)


def test_chat_stream_role_first_then_content_then_finish(http):
    chunks = stream(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5, "temperature": 0,
                                                   "ignore_eos": True, "n": 2,
                                                   "stream_options": {"include_usage": True}})
    first, *middle, last = chunks
    assert first["object"] == "chat.completion.chunk" and first["id"].startswith("chatcmpl-")
    assert [c["delta"] for c in first["choices"]] == [{"role": "assistant", "content": ""}] * 2
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in middle
                if c["choices"][0]["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}
    for chunk in middle:
        (choice,) = chunk["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason", "stop_reason"}
        assert set(choice["delta"]) <= {"content"}


def test_completion_response_shape(http):
    r = http.post("/v1/completions", json={"prompt": "A list", "max_tokens": 4, "temperature": 0, "n": 2,
                                           "ignore_eos": True, "user": "someone"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == COMPLETION_KEYS and body["object"] == "text_completion"
    assert body["model"] == "tiny"  # the name asked for, defaulting to the first served name
    assert [set(c) for c in body["choices"]] == [{"index", "text", "logprobs", "finish_reason", "stop_reason"}] * 2
    assert body["usage"]["completion_tokens"] == 8 and set(body["usage"]) == USAGE_KEYS


def test_chat_response_shape(http):
    body = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 3}).json()
    assert set(body) == COMPLETION_KEYS and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason", "stop_reason"}
    assert set(choice["message"]) == {"role", "content"} and choice["logprobs"] is None


def test_completion_logprobs_shape_and_text_offsets(http):
    body = http.post("/v1/completions", json={"prompt": "A list", "max_tokens": 5, "temperature": 0,
                                              "ignore_eos": True, "logprobs": 2}).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == 5 and lp["text_offset"][0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"])
    # streamed, the offsets go on from chunk to chunk
    chunks = stream(http, "/v1/completions", {"prompt": "A list", "max_tokens": 5, "temperature": 0,
                                              "ignore_eos": True, "logprobs": 2})
    merged = {k: sum((c["choices"][0]["logprobs"][k] for c in chunks), []) for k in lp}
    assert merged == lp


def test_text_offsets_count_characters_of_the_text_not_of_byte_tokens(http):
    # "日" is three byte tokens, shown as "bytes:\xe6"...; they add one character between them
    body = {"prompt": "日本語 ok", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 0}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert lp["tokens"][0].startswith("bytes:")
    assert lp["text_offset"][:4] == [0, 0, 0, 1]
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] <= len(text)
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        if not token.startswith(("bytes:", "<|")):
            assert text[offset:offset + len(token)] == token
    chunks = stream(http, "/v1/completions", body)
    assert sum((c["choices"][0]["logprobs"]["text_offset"] for c in chunks), []) == lp["text_offset"]


def test_text_offsets_skip_the_special_tokens_the_text_skips(http):
    # ignore_eos lets the end-of-text token come mid-output; the text leaves it out, so must the offsets
    body = {"prompt": "A list", "max_tokens": 3, "ignore_eos": True, "logit_bias": {"0": 100}, "logprobs": 0}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == "" and choice["logprobs"]["text_offset"] == [0, 0, 0]
    echoed = http.post("/v1/completions", json={**body, "prompt": [1, 2], "echo": True}).json()["choices"][0]
    prompt_text = echoed["text"]   # an echoed prompt's special tokens are in its text
    assert echoed["logprobs"]["text_offset"][2:] == [len(prompt_text)] * 3


def test_chat_logprobs_shape(http):
    body = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "logprobs": True,
                                                   "top_logprobs": 3, "ignore_eos": True}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 3
        assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])


def test_echo_prepends_the_prompt(http):
    body = http.post("/v1/completions", json={"prompt": "A list", "max_tokens": 3, "temperature": 0,
                                              "echo": True}).json()
    plain = http.post("/v1/completions", json={"prompt": "A list", "max_tokens": 3, "temperature": 0}).json()
    assert body["choices"][0]["text"] == "A list" + plain["choices"][0]["text"]
    chunks = stream(http, "/v1/completions", {"prompt": "A list", "max_tokens": 3, "temperature": 0, "echo": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]


def test_multibyte_characters_forced_by_logit_bias_stream_whole(http, offline):
    # only the two byte tokens of "é" can win, and the frequency penalty makes them take turns:
    # the output is "é" split over two tokens (plus stray halves), which a stream must never cut
    texts = TokenTexts(offline.tokenizer)
    byte_ids = [t for t in offline.tokenizer.encode("é", add_special_tokens=False) if len(texts.get(t)[0]) == 1]
    assert len(byte_ids) == 2, "the tokenizer should split é into its two bytes"
    sampling = dict(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=2.0)
    ref = offline.generate("Text:", SamplingParams(**sampling, logit_bias={t: 100.0 for t in byte_ids}),
                           use_tqdm=False)[0]
    assert set(ref.token_ids) == set(byte_ids) and "é" in ref.text
    body = {"prompt": "Text:", **sampling, "logit_bias": {str(t): 100.0 for t in byte_ids}}
    chunks = [c["choices"][0]["text"] for c in stream(http, "/v1/completions", body)]
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    # a chunk cut inside "é" would put a U+FFFD where the whole text has the character
    assert "".join(chunks) == whole == ref.text == offline.tokenizer.decode(ref.token_ids)
    assert len(chunks) > 1


def test_bytes_that_complete_no_character_stream_as_they_come(http, offline):
    # only "é"'s second byte may be drawn: a run of UTF-8 continuation bytes, which no character
    # completes. It was held to the end (one chunk after the whole generation), every token
    # decoding the whole run again on the event loop
    texts = TokenTexts(offline.tokenizer)
    second = [t for t in offline.tokenizer.encode("é", add_special_tokens=False) if len(texts.get(t)[0]) == 1][-1]
    body = {"prompt": "Text:", "max_tokens": 200, "ignore_eos": True, "allowed_token_ids": [second]}
    chunks = [c["choices"][0]["text"] for c in stream(http, "/v1/completions", body)]
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert "".join(chunks) == whole == offline.tokenizer.decode([second] * 200)
    assert sum(1 for c in chunks if c) > 5


def test_models_health_version_metrics(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "tiny" and card["object"] == "model" and {"created", "owned_by"} <= set(card)
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    metrics = http.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "request_time_per_output_token_seconds_bucket"):
        assert f"nanoserve:{name}" in metrics.text
    # every series carries the served model's name, as vLLM's do (its dashboards select by it)
    samples = [line for line in metrics.text.splitlines() if line and not line.startswith("#")]
    assert len(samples) > 50 and all('model_name="tiny"' in line for line in samples), samples[:3]


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/tiny", "/health", "/ping", "/version", "/metrics",
                                  "/tokenizer_info"])
def test_every_get_route_answers_head_with_no_body(http, path):
    got, head = http.get(path), http.head(path)
    assert head.status_code == got.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]
    assert http.head("/v1/models/nope").status_code == 404


@pytest.mark.parametrize("method, path", [("GET", "//health"), ("GET", "/health/"), ("GET", "/v1/models/"),
                                          ("GET", "/v1//models"), ("POST", "/v1/completions/"),
                                          ("POST", "//v1/completions"), ("POST", "/v1//chat/completions/")])
def test_a_trailing_or_doubled_slash_is_served_as_the_route_not_redirected(http, server, method, path):
    # Starlette answered a trailing slash with a 307, which some clients follow by posting again
    canonical = "/" + "/".join(part for part in path.split("/") if part)
    asked = {"messages": MESSAGES} if "chat" in path else {"prompt": "hi"}
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0, **asked} if method == "POST" else None
    # the whole URL: a path of its own that starts with "//" would name a host
    got, expected = http.request(method, server.url + path, json=body), http.request(method, canonical, json=body)
    assert got.status_code == expected.status_code == 200, got.text
    assert got.headers["content-type"] == expected.headers["content-type"]
    if method == "POST":
        assert got.json()["choices"][0] == expected.json()["choices"][0]
    unknown = http.post("/v1/nothing/", json=body or {})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"


def test_tokenize_and_detokenize_round_trip(http, offline):
    text = "A dict maps keys to values: 日本"
    tok = http.post("/tokenize", json={"prompt": text}).json()
    assert tok["tokens"] == offline.tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 2048
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    rendered = offline.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == offline.tokenizer.encode(rendered, add_special_tokens=False)
    assert tok["token_strs"] is None and chat["token_strs"] is None


def test_tokenize_takes_vllms_token_strings_and_continued_final_message(http, offline):
    tok = http.post("/tokenize", json={"prompt": "A dict maps", "return_token_strs": True}).json()
    assert tok["token_strs"] == offline.tokenizer.convert_ids_to_tokens(tok["tokens"])
    messages = [*MESSAGES, {"role": "assistant", "content": "A dict is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    cont = http.post("/tokenize", json=body).json()
    rendered = offline.tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert cont["tokens"] == offline.tokenizer.encode(rendered, add_special_tokens=False)
    assert offline.tokenizer.decode(cont["tokens"]).endswith("A dict is")
    r = http.post("/tokenize", json={**body, "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_token_strings_of_a_long_prompt_are_named_off_the_event_loop(server_model):
    """A Python call per token: 570k of them on the event loop held every stream for 0.35 s."""

    engine = tiny_engine(server_model)
    named_on = []
    convert = engine.tokenizer.convert_ids_to_tokens
    engine.tokenizer.convert_ids_to_tokens = lambda ids: named_on.append(threading.current_thread()) or convert(ids)
    with serving(engine) as (url, loop_thread):
        r = httpx.post(f"{url}/tokenize", json={"prompt": "a b " * 5000, "return_token_strs": True}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    body = r.json()
    assert len(body["token_strs"]) == body["count"] > 8192 and body["token_strs"][:2] == convert(body["tokens"][:2])
    assert named_on and loop_thread not in named_on


def test_cors_is_off_by_default(http):
    r = http.options("/v1/completions", headers={"Origin": "https://app.example",
                                                 "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in http.get("/v1/models", headers={"Origin": "https://a.b"}).headers


def test_each_finished_request_leaves_one_log_line(http, server):
    body = http.post("/v1/completions", json={"prompt": "A list", "max_tokens": 5, "temperature": 0,
                                              "ignore_eos": True}).json()
    deadline = time.monotonic() + 10
    while body["id"] not in server.log_tail(200_000) and time.monotonic() < deadline:
        time.sleep(0.05)
    (line,) = [line for line in server.log_tail(200_000).splitlines() if body["id"] in line]
    assert "2 prompt + 5 generated tokens" in line and "TTFT" in line and "finish length" in line


def test_a_stream_of_large_chunks_gives_the_event_loop_a_turn_after_each(server_model, monkeypatch):
    """Updates already queued pass without a pause: 128 choices, each opening with 2k echoed
    tokens of logprobs, were built back to back and held every other request for 6.5 s."""
    import asyncio
    import types

    from nanoserve.server import response

    pauses = []

    async def counted_sleep(delay, *args):
        pauses.append(delay)
        return await asyncio.sleep(delay, *args)

    monkeypatch.setattr(response, "asyncio", types.SimpleNamespace(**{**vars(asyncio), "sleep": counted_sleep}))
    engine = tiny_engine(server_model, 256)
    body = {"model": "tiny", "prompt": [100 + (7 * i) % 3000 for i in range(600)], "max_tokens": 1, "n": 3,
            "echo": True, "logprobs": 20, "stream": True}
    with serving(engine) as (url, _):
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: {")]
    large = [e for e in events if len(e) > response.LARGE_EVENT_BYTES]
    assert len(large) == 3   # each choice opens with its echoed prompt's logprobs
    assert pauses.count(0) >= len(large)


def test_large_chat_template_kwargs_are_rendered_off_the_event_loop(server_model):
    """transformers copies every template variable before rendering: a million small values held
    every stream for 0.7 s when the render ran on the event loop."""

    engine = tiny_engine(server_model)
    rendered_on = []
    render = engine.tokenizer.apply_chat_template
    engine.tokenizer.apply_chat_template = (lambda *args, **kwargs: rendered_on.append(threading.current_thread())
                                            or render(*args, **kwargs))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with serving(engine) as (url, loop_thread):
        for kwargs in ({"unused": 1}, {"unused": list(range(5_000))}):
            r = httpx.post(f"{url}/v1/chat/completions", json={**body, "chat_template_kwargs": kwargs}, timeout=60)
            assert r.status_code == 200, r.text[:300]
    small, large = rendered_on
    assert small is loop_thread and large is not loop_thread
