"""Per-request limits: body bytes (413 before reading), prompt characters (400 before tokenizing),
prompts x n, and stop lists; each refused with an OpenAI error naming the field."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess

MB = 1024 * 1024
OK = {"model": "tiny", "prompt": "A list is a sequence of", "max_tokens": 4}


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):
    # default body limit (32 MiB); small stop and sequence limits so that the tests stay small
    with ServerProcess(server_model, tmp_path_factory.mktemp("limits"), "--num-kvcache-blocks", "256",
                       "--block-size", "16", "--max-stop-strings", "4", "--max-stop-string-chars", "16",
                       "--max-stop-token-ids", "4") as proc:
        yield proc


def peak_rss_mb(server: ServerProcess) -> float:
    status = open(f"/proc/{server.proc.pid}/status").read()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) / 1024


def test_a_50_mb_body_is_refused_with_413_before_it_is_read(server):
    before = peak_rss_mb(server)
    # declared length over the limit: the answer comes after the headers, the body never sent
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (50 * MB))
        head = b""
        while chunk := sock.recv(65536):  # the server closes after its answer
            head += chunk
        assert time.monotonic() - start < 2
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b'"code":"request_too_large"' in head and b"--max-request-body-bytes" in head
    # and a client that sends all 50 MB gets the same answer, not a server holding 50 MB
    body = b'{"prompt": "' + b"a" * (50 * MB) + b'"}'
    start = time.monotonic()
    try:
        r = httpx.post(f"{server.url}/v1/completions", content=body,
                       headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    except httpx.WriteError:
        pass  # the server answered and closed while the client was still writing: refused too
    assert time.monotonic() - start < 10
    assert peak_rss_mb(server) - before < 40  # never the 50 MB, let alone the gigabytes of tokenizing
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_chunked_body_over_the_limit_is_cut_off_at_the_limit(server):
    before = peak_rss_mb(server)

    def chunks():
        for _ in range(50):
            yield b"x" * MB

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert peak_rss_mb(server) - before < 80  # at most the 32 MiB limit was held


def chunked_request(body: bytes, chunk: int) -> bytes:
    """A POST /v1/completions whose body is sent in chunks of `chunk` bytes (Transfer-Encoding: chunked)."""
    pieces = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + chunk]), body[i:i + chunk]) for i in range(0, len(body), chunk))
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + pieces + b"0\r\n\r\n")


def test_a_body_in_too_many_chunks_is_refused_while_it_is_read(server):
    # each chunk is a Python call, and uvicorn joins each to the body read so far: a 16 MB body in
    # 1-byte chunks held the event loop for 10 s (a neighbour stream paused 3.6 s), where the
    # same body in one piece took 0.15 s
    body = b'{"model": "tiny", "prompt": "' + b"a" * 200_000 + b'", "max_tokens": 1}'
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        try:
            sock.sendall(chunked_request(body, 1))
        except OSError:
            pass  # refused and closed while the rest was still being sent
        answer = b""
        while chunk := sock.recv(65536):  # the server closes after its answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b'"code":"too_many_body_chunks"' in answer
    # a body in chunks of a sensible size is served
    ok = json.dumps(OK).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(chunked_request(ok, 4))
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 200"), head[:300]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_5_mb_prompt_is_refused_before_tokenizing(server):
    before = peak_rss_mb(server)
    for path, body, param in [("/v1/completions", {**OK, "prompt": "list " * MB}, "prompt"),
                              ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4,
                                                        "messages": [{"role": "user", "content": "list " * MB}]},
                               "messages"),
                              ("/tokenize", {"prompt": "list " * MB}, "prompt")]:
        start = time.monotonic()
        r = httpx.post(server.url + path, json=body, timeout=30)
        elapsed = time.monotonic() - start
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "max_model_len" in error["message"]
        # tokenizing it takes ~4 s on a 2-core CPU; refusing it, a fraction of one (2 s leaves room for a busy machine)
        assert elapsed < 2.0, f"{path} took {elapsed:.2f}s: was the prompt tokenized?"
    # tokenizing 5 MB peaks near a gigabyte; parsing it costs a few times its size
    assert peak_rss_mb(server) - before < 100


def test_a_batch_of_over_long_prompts_is_refused_at_the_first_one(server):
    # each text is within the characters a context could hold, but 24,000 tokens long: all 256 were
    # tokenized (13 s on a 2-core CPU, the body's 31 MB at once) before the first was refused
    body = {**OK, "prompt": ["word " * 24_000] * 256}
    start = time.monotonic()
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    elapsed = time.monotonic() - start
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert "24001 tokens" in error["message"]
    assert elapsed < 3.0, f"took {elapsed:.2f}s: was every prompt tokenized?"


def test_truncate_prompt_tokens_keeps_the_end_of_a_long_prompt_without_tokenizing_it_all(server):
    tail = " A list is a sequence of"
    start = time.monotonic()
    r = httpx.post(f"{server.url}/v1/completions", json={**OK, "prompt": "dict " * MB + tail,
                                                          "truncate_prompt_tokens": 20, "temperature": 0}, timeout=30)
    elapsed = time.monotonic() - start
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 20 and elapsed < 2.0
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "dict " * 40 + tail}, timeout=30).json()["tokens"]
    same = httpx.post(f"{server.url}/v1/completions", json={**OK, "prompt": tokens[-20:], "temperature": 0},
                      timeout=30).json()
    assert r.json()["choices"][0]["text"] == same["choices"][0]["text"]


def test_truncate_prompt_tokens_minus_one_keeps_what_the_context_holds(server):
    """vLLM's -1: the prompt's last max_model_len tokens; a prompt that fits is kept whole."""
    words = "A list is a sequence of things. " * 30
    chat = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": words}]}
    for path, body in (("completions", {**OK, "prompt": words}), ("chat/completions", chat)):
        kept = httpx.post(f"{server.url}/v1/{path}", json={**body, "temperature": 0, "truncate_prompt_tokens": -1},
                          timeout=30)
        assert kept.status_code == 200, kept.text
        plain = httpx.post(f"{server.url}/v1/{path}", json={**body, "temperature": 0}, timeout=30).json()
        assert kept.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] > 100
        assert kept.json()["choices"] == plain["choices"]
    # past the context, the kept end is the whole context: no room is left for an output token
    long = httpx.post(f"{server.url}/v1/completions", timeout=30,
                      json={**OK, "prompt": words * 40, "truncate_prompt_tokens": -1, "max_tokens": 1})
    assert long.status_code == 400 and "truncate_prompt_tokens" not in long.json()["error"]["message"]


def test_chat_truncate_prompt_tokens_keeps_the_end_of_a_conversation_longer_than_the_context(server):
    # /v1/completions keeps a long text's end; chat refused the same text (400 context_length_exceeded)
    # before rendering it, as it did a conversation of more messages than the context has tokens
    chat = {"model": "tiny", "max_tokens": 4, "temperature": 0, "truncate_prompt_tokens": 20}

    def long(words: int) -> list[dict]:
        return [{"role": "user", "content": "dict " * words + "A list is a sequence of"}]

    def many(messages: int) -> list[dict]:
        return [{"role": "user", "content": "hi"}] * messages + long(0)

    for messages, ending in ((long(MB), long(40)), (many(5000), many(10))):
        start = time.monotonic()
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "messages": messages}, timeout=30)
        elapsed = time.monotonic() - start
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 20 and elapsed < 5.0
        # the same last 20 tokens as a short conversation of the same end renders to
        tokens = httpx.post(f"{server.url}/tokenize", timeout=30,
                            json={"messages": ending, "add_special_tokens": False}).json()["tokens"]
        same = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={**OK, "prompt": tokens[-20:], "temperature": 0}).json()
        assert r.json()["choices"][0]["message"]["content"] == same["choices"][0]["text"]
    # without truncation the same conversation is refused, by name
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "truncate_prompt_tokens": None,
                                                              "messages": long(MB)}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_10000_prompt_request_is_refused_while_others_are_served(server):
    streamed: list[str] = []

    def stream():
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                          json={**OK, "max_tokens": 60, "ignore_eos": True, "stream": True}) as r:
            streamed.extend(line for line in r.iter_lines() if line.startswith("data: "))

    thread = threading.Thread(target=stream)
    thread.start()
    r = httpx.post(f"{server.url}/v1/completions", json={**OK, "prompt": ["hi"] * 10000}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "10000 prompt(s) x n=1 = 10000 sequences" in r.json()["error"]["message"]
    assert "--max-seqs-per-request" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={**OK, "prompt": ["hi"] * 3, "n": 100}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 128, "max_tokens": 4})
    assert r.status_code == 200, r.text  # 128 <= 256, the default
    thread.join(120)
    assert streamed[-1] == "data: [DONE]" and len(streamed) > 10
    server.wait_idle()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value, words", [
    ("stop", ["a", "b", "c", "d", "e"], "at most 4 (--max-stop-strings)"),
    ("stop", "x" * 17, "at most 16 (--max-stop-string-chars)"),
    ("stop", ["ok", "y" * 100], "100 characters"),
    ("stop_token_ids", [1, 2, 3, 4, 5], "at most 4 (--max-stop-token-ids)"),
])
def test_stop_lists_are_bounded(server, path, field, value, words):
    body = {**OK, field: value} if path == "/v1/completions" else \
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, field: value}
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and words in r.json()["error"]["message"]
    within = value[:16] if isinstance(value, str) else [v[:16] if isinstance(v, str) else v for v in value[:4]]
    assert httpx.post(server.url + path, json={**body, field: within}, timeout=30).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("stop", ["", ["x", ""]])
def test_an_empty_stop_string_is_a_400_as_vllm_answers_it(server, path, stop):
    # it was dropped without a word: a client that sent one believed it would stop somewhere
    body = {"model": "tiny", "stop": stop}
    body |= ({"prompt": "hi", "max_tokens": 4} if path == "/v1/completions" else
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} if path == "/v1/chat/completions"
             else {"input": "hi", "max_output_tokens": 4})
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stop" and "stop cannot contain an empty string" in r.json()["error"]["message"]
    assert httpx.post(server.url + path, json={**body, "stop": ["x"]}, timeout=30).status_code == 200


def test_an_empty_stop_string_is_refused_offline_too():
    from nanoserve import SamplingParams
    from nanoserve.sampling_params import InvalidSamplingParam

    with pytest.raises(InvalidSamplingParam) as caught:
        SamplingParams(stop=["x", ""])
    assert caught.value.param == "stop"


def test_a_body_of_millions_of_json_values_is_refused_before_it_is_parsed(server):
    # 1.5 million values in 3 MB: parsed, they would hold the interpreter lock, and every stream, for long
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 4, "metadata": {"a": [' + b"0," * 1_500_000 + b"0]}}"
    start = time.monotonic()
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=30)
    assert time.monotonic() - start < 5
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "request_too_complex" and "--max-request-json-values" in error["message"]
    assert "holds about 15000" in error["message"] and "at most 1048576" in error["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body.replace(b'"prompt": "hi"', b'"messages": []'),
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413, r.text
    # a body with fewer values is served (a prompt of 1,000 token ids)
    r = httpx.post(f"{server.url}/v1/completions", json={**OK, "prompt": [0] * 1000}, timeout=30)
    assert r.status_code == 200, r.text


def test_logit_bias_past_its_entry_limit_is_a_400_naming_it(server):
    r = httpx.post(f"{server.url}/v1/completions", json={**OK, "logit_bias": {str(i): 0 for i in range(131073)}},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_bias" and "131072" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={**OK, "logit_bias": {str(i): 0 for i in range(1000)}},
                   timeout=30)
    assert r.status_code == 200, r.text


def test_comma_rich_prompt_text_does_not_count_as_json_values(server):
    # 1.2 million commas and colons, all inside one string: one value, and the prompt check answers
    r = httpx.post(f"{server.url}/v1/completions", json={**OK, "prompt": "a,b:" * 600_000}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
