"""Output that clients leave unread is held within --max-undelivered-mb over the whole server: the
responses furthest behind are ended (aborted in the engine, their connections closed), and others
are served as usual.

Loopback's kernel buffers take ~4 MB of a response that is not read before the server's writes
back up, so the unread responses here are larger: a long prompt echoed with 20 logprobs a token
to 8 choices, ~7 MB, generated in about a second.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess

BUDGET_MB = 2
ECHOED = {"model": "tiny", "prompt": [100 + i % 200 for i in range(1500)], "n": 8, "logprobs": 20, "echo": True}


@pytest.fixture(scope="module")
def budgeted(server_model, tmp_path_factory):
    with ServerProcess(server_model, tmp_path_factory.mktemp("budget"), "--num-kvcache-blocks", "1024",
                       "--block-size", "16", "--max-undelivered-mb", str(BUDGET_MB)) as proc:
        yield proc


def unread(server: ServerProcess, body: dict) -> socket.socket:
    """A request whose client reads none of the answer, with a receive buffer of 4 KB."""
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    chunks = []
    try:
        while chunk := sock.recv(1 << 20):
            chunks.append(chunk)
    except ConnectionError:   # aborted: the server reset the connection
        pass
    return b"".join(chunks)


def ended(server: ServerProcess) -> int:
    return int(server.metrics()["nanoserve:undelivered_output_ended_requests_total"])


def wait_for_ended(server: ServerProcess, count: int, timeout: float = 90.0) -> None:
    # generous: 8 echoed prompts of 2,000 tokens with 20 logprobs each took over 30 s on 2 cores under the whole suite
    deadline = time.monotonic() + timeout
    while ended(server) < count:
        assert time.monotonic() < deadline, f"only {ended(server)} of {count} unread responses were ended"
        time.sleep(0.1)


def test_streams_nobody_reads_are_ended_and_aborted_while_a_reading_client_is_served(budgeted):
    before = ended(budgeted)
    # still generating when their echoed prompts back up: the engine must abort them
    slow = [unread(budgeted, {**ECHOED, "max_tokens": 300, "ignore_eos": True, "stream": True}) for _ in range(2)]
    held: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            held.append(budgeted.metrics()["nanoserve:undelivered_output_bytes"])
            stop.wait(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        body = {"model": "tiny", "prompt": "A list is", "max_tokens": 32, "ignore_eos": True, "logprobs": 5,
                "stream": True}
        with httpx.stream("POST", f"{budgeted.url}/v1/completions", json=body, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        wait_for_ended(budgeted, before + 2)
    finally:
        stop.set()
        sampler.join()
    budgeted.wait_idle(timeout=10)   # aborted in the engine, KV blocks freed, long before 8 x 300 tokens
    for sock in slow:
        assert b"data: [DONE]" not in read_until_closed(sock)   # cut off, not finished
        sock.close()
    log = budgeted.log_tail(200_000)
    assert len(re.findall(r"cmpl-\S+ ended: its client left [\d.]+ MB of output unread", log)) >= 2
    # held within the budget, give or take what arrives between two checks of it
    assert held and max(held) < 1.5 * BUDGET_MB * 2**20
    assert budgeted.metrics()["nanoserve:undelivered_output_bytes"] <= BUDGET_MB * 2**20


def test_a_whole_response_nobody_reads_is_ended(budgeted):
    before = ended(budgeted)
    # a longer prompt than the streams': its outputs keep the prompt's logprobs as packed arrays (a
    # quarter of a MB), so what the budget sees is the written body, two choices of ~1.2 MB at a time
    sock = unread(budgeted, {**ECHOED, "prompt": [100 + i % 200 for i in range(2000)], "max_tokens": 1})
    wait_for_ended(budgeted, before + 1)
    received = read_until_closed(sock)
    sock.close()
    head, _, body = received.partition(b"\r\n\r\n")
    # the body was cut off; a check between the engine's end and the first write ends it before its
    # head is sent (its outputs are held all the same), so nothing may have arrived at all
    assert (head.startswith(b"HTTP/1.1 200") or received == b"") and not body.endswith(b"}")
    budgeted.wait_idle(timeout=10)
    r = httpx.post(f"{budgeted.url}/v1/completions", json={"model": "tiny", "prompt": "A", "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 200
