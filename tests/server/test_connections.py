"""Connections cannot pile up: idle, slow-header and unfinished-body ones are closed, and past the cap
only /health is served."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess, metrics_text, openai_client

HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def impatient(server_model, tmp_path_factory):
    with ServerProcess(server_model, tmp_path_factory.mktemp("impatient"), "--num-kvcache-blocks", "128",
                       "--block-size", "16", "--timeout-keep-alive", "1", "--timeout-headers", "1.5",
                       "--timeout-body", "2") as proc:
        yield proc


def connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(10)
    return sock


def seconds_until_closed(sock: socket.socket, drip: bytes = b"") -> float:
    """Wait for the server to close the connection (recv gives b""), sending `drip` a byte at a time."""
    start = time.monotonic()
    sock.settimeout(0.25)
    for byte in [drip[i:i + 1] for i in range(len(drip))] + [b""] * 200:
        try:
            if byte:
                sock.sendall(byte)
            data = sock.recv(65536)
            if data == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except ConnectionError:
            return time.monotonic() - start
    raise AssertionError("the server never closed the connection")


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(impatient):
    with connect(impatient) as sock:
        sock.sendall(HEALTH)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert 0.5 < seconds_until_closed(sock) < 3


def test_a_connection_that_never_sends_a_request_is_closed(impatient):
    with connect(impatient) as sock:
        assert 1.0 < seconds_until_closed(sock) < 4


def test_headers_sent_a_byte_at_a_time_are_cut_off_at_the_header_deadline(impatient):
    # slowloris: every byte resets no timer; the deadline runs from the first byte
    with connect(impatient) as sock:
        elapsed = seconds_until_closed(sock, drip=b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100)
        assert 1.0 < elapsed < 4
    # the same on a kept-alive connection, after a first request was answered
    with connect(impatient) as sock:
        sock.sendall(HEALTH)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        elapsed = seconds_until_closed(sock, drip=b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100)
        assert 1.0 < elapsed < 4


def test_a_body_that_never_finishes_is_cut_off_at_the_body_deadline(impatient):
    with connect(impatient) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        assert 1.5 < seconds_until_closed(sock, drip=b' "slow') < 5   # bytes keep coming, too few
    assert httpx.post(f"{impatient.url}/v1/completions", json={"prompt": "A list", "max_tokens": 2},
                      timeout=30).status_code == 200


def test_a_slow_request_whose_headers_arrived_is_not_cut_off(impatient):
    # the deadline is for the headers only: a stream longer than it runs to its end
    # long enough to outlast the deadline on a fast machine too (400 tokens took 1.3 s here)
    body = {"prompt": "A list", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", f"{impatient.url}/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - start > 1.5, "the stream must outlast the header deadline to show anything"
    assert lines[-1] == "data: [DONE]" and len(lines) > 100


def _finished_length(server: ServerProcess) -> float:
    text = metrics_text(server.url)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('nanoserve:request_success_total{finished_reason="length"'))


def test_a_reader_cut_off_at_the_body_deadline_still_counts_what_the_engine_generated(server_model, tmp_path):
    # the metrics counted the tokens and finishes that the response had sent when the connection was
    # closed: 2,233 of 4,000 tokens and one of four finishes for one such stream
    proc = ServerProcess(server_model, tmp_path, "--num-kvcache-blocks", "512", "--block-size", "16",
                         "--timeout-body", "15", "--max-logprobs", "100")
    # some 6 MB of events, more than the kernel's socket buffers take in, from a few seconds of
    # generation (100 alternatives a token): the deadline has to outlast them on a slow, busy machine
    body = json.dumps({"messages": [{"role": "user", "content": "A list"}], "max_tokens": 250, "n": 4,
                       "logprobs": True, "top_logprobs": 100, "ignore_eos": True, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # the answer's megabytes stay unread
    try:
        sock.connect(("127.0.0.1", proc.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while proc.metrics()["nanoserve:num_requests_running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.wait_idle(60)   # the engine finishes all four choices while nothing is read
        while (m := proc.metrics())["nanoserve:generation_tokens_total"] == 0:
            assert time.monotonic() < deadline + 60, "the body deadline never closed the connection"
            time.sleep(0.2)   # counted once the response ends: when the body deadline closes it
        assert m["nanoserve:generation_tokens_total"] == 1000
        assert _finished_length(proc) == 4
        log = proc.log_path.read_text(errors="replace")
        assert "(--timeout-body): connection closed" in log and "never sent: the client went away" in log
    finally:
        sock.close()
        proc.stop()


def test_past_the_connection_cap_requests_get_503_but_health_answers(server_model, tmp_path):
    proc = ServerProcess(server_model, tmp_path, "--num-kvcache-blocks", "128", "--block-size", "16",
                         "--max-connections", "4", "--timeout-headers", "60")
    held = [connect(proc) for _ in range(4)]
    try:
        time.sleep(0.2)
        with httpx.Client(base_url=proc.url, timeout=10) as client:
            r = client.post("/v1/completions", json={"prompt": "A list", "max_tokens": 2})
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "too_many_connections" and "--max-connections" in error["message"]
            assert r.headers["connection"] == "close"
        health = httpx.get(f"{proc.url}/health", timeout=10)
        assert health.status_code == 200 and health.headers["connection"] == "close"
        extra = [connect(proc) for _ in range(20)]   # a flood past the cap is one log line, not one each
        time.sleep(0.3)
        for sock in extra:
            sock.close()
        assert proc.log_path.read_text(errors="replace").count("open connections (--max-connections 4)") == 1
        for sock in held:
            sock.close()
        time.sleep(0.2)
        r = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "A list", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        for sock in held:
            sock.close()
        proc.stop()


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionError):
        pass
    return data


def test_headers_over_64kb_get_431_and_the_connection_closes(impatient):
    # httptools caps neither a header's size nor their number: 100 MB of small headers took 1.1 GB
    sock = connect(impatient)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
    try:
        for i in range(64):   # 256 KB in all, within the header deadline
            sock.sendall(b"".join(b"X-%d-%d: v\r\n" % (i, j) for j in range(400)))
    except ConnectionError:   # refused (and closed) before all of it went out
        pass
    reply = read_until_closed(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), reply[:200]
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    assert httpx.get(f"{impatient.url}/health", timeout=10).status_code == 200


def test_a_burst_of_pipelined_requests_larger_than_the_head_cap_is_answered_in_full(impatient):
    # a read that continued a head was counted whole as head bytes, the pipelined requests after
    # the head too: past 64 KB the connection was closed with the rest of the burst unanswered
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    count = 12_000   # 420 KB, over several reads, most of them beginning inside a request
    sock = connect(impatient)
    sender = threading.Thread(target=sock.sendall, args=(request * count + request.replace(
        b"Host: x", b"Host: x\r\nConnection: close"),))
    sender.start()
    replies = read_until_closed(sock)
    sender.join()
    assert replies.count(b"HTTP/1.1 200 OK") == count + 1


def test_headers_under_the_cap_are_served(impatient):
    response = httpx.get(f"{impatient.url}/v1/models", timeout=10,
                         headers={f"x-{i}": "v" * 100 for i in range(300)})   # ~32 KB
    assert response.status_code == 200


@pytest.mark.parametrize("request_bytes", [
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 50,   # TLS to a plain HTTP port
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\x01b\r\n\r\n",
], ids=["tls-hello", "two-content-lengths", "control-character"])
def test_a_request_http_cannot_parse_gets_an_openai_error_object(impatient, request_bytes):
    sock = connect(impatient)
    sock.sendall(request_bytes)
    head, _, body = read_until_closed(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower(), head
    assert json.loads(body)["error"]["code"] == "invalid_http_request"


# what `curl --http2` sends to an http:// URL, asking to switch to HTTP/2 (h2c)
H2C_UPGRADE = {"Connection": "Upgrade, HTTP2-Settings", "Upgrade": "h2c", "HTTP2-Settings": "AAMAAABkAAQCAAAAAAIAAAAA"}


def test_a_request_that_asks_to_upgrade_is_served_over_http_1_1_body_and_all(impatient):
    # httptools skips the body of a request that asks for an upgrade, so the route read an empty
    # body: curl --http2 got a 400 for invalid JSON, however good the request
    client = openai_client(impatient.url)
    kwargs = dict(model="tiny", prompt="The function", max_tokens=6, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs, extra_headers=H2C_UPGRADE).choices[0].text == plain
    streamed = client.completions.create(**kwargs, stream=True, extra_headers={**H2C_UPGRADE, "Upgrade": "websocket"})
    assert "".join(chunk.choices[0].text for chunk in streamed) == plain
    # the connection goes on: a request after it on the same socket is read from where the body ended
    body = json.dumps(kwargs).encode()
    upgrade = "".join(f"{k}: {v}\r\n" for k, v in H2C_UPGRADE.items()).encode()
    sock = connect(impatient)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n%bContent-Length: %d\r\n\r\n%b"
                 % (upgrade, len(body), body) + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    replies = read_until_closed(sock).split(b"HTTP/1.1 ")
    assert [r.split(b"\r\n")[0] for r in replies[1:]] == [b"200 OK", b"200 OK"], replies


@pytest.mark.parametrize("request_bytes, status", [
    (b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n", b"404"),
    (b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n", b"405"),
], ids=["websocket", "connect"])
def test_a_websocket_handshake_or_a_tunnel_gets_an_openai_error_object(impatient, request_bytes, status):
    # a WebSocket handshake was answered 403 with an empty text body (no route takes one)
    sock = connect(impatient)
    sock.sendall(request_bytes)
    head, _, body = read_until_closed(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 " + status) and b"content-type: application/json" in head.lower(), head
    assert json.loads(body)["error"]["message"]


def test_an_http_1_0_stream_is_sent_unchunked_and_ends_with_the_connection(impatient):
    # HTTP/1.0 has no chunked coding: its clients would read the chunk sizes as part of the events
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": True,
                       "ignore_eos": True}).encode()
    sock = connect(impatient)
    sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % len(body) + body)
    head, _, events = read_until_closed(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding" not in head.lower(), head
    assert events.startswith(b"data: {") and events.endswith(b"data: [DONE]\n\n"), events[-200:]
    chunks = [json.loads(event[len(b"data: "):]) for event in events.split(b"\n\n")[:-2]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # a body of known length keeps its Content-Length
    sock = connect(impatient)
    sock.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
    head, _, models = read_until_closed(sock).partition(b"\r\n\r\n")
    assert b"content-length: %d" % len(models) in head.lower() and json.loads(models)["object"] == "list"


def test_a_client_that_reads_none_of_its_stream_is_cut_off_at_the_body_deadline(impatient):
    # it would hold what is left of its response for good. 9 MB of echoed prompt logprobs: more than
    # the kernel's socket buffers (4 MB on loopback) take, so the server's own writes back up
    body = json.dumps({"model": "tiny", "prompt": [100 + i % 200 for i in range(1900)], "max_tokens": 1, "n": 8,
                       "logprobs": 20, "echo": True, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", impatient.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 30
    while "read none of its response" not in impatient.log_tail(20000):
        assert time.monotonic() < deadline, "the unread stream was never cut off"
        time.sleep(0.25)
    impatient.wait_idle()
    sock.settimeout(2)
    assert b"data: [DONE]" not in read_until_closed(sock)   # the stream was cut, not finished
