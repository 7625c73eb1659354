"""A structured-output spec that would take minutes to compile gets a 400 at the deadline, and
holds up neither other structured requests nor the engine."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import SERVER_ARGS, ServerProcess, engine_process, spawned_children

# xgrammar's compile time grows steeply with repeated optional parts: 1.6 KB of this took 10 s on
# a 2-core CPU, and this (4 KB) takes minutes
SLOW_REGEX = "a*" * 2000
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):
    with ServerProcess(server_model, tmp_path_factory.mktemp("grammar-limit"), *SERVER_ARGS,
                       "--timeout-grammar-compile", "2") as proc:
        yield proc


def test_a_spec_that_compiles_too_slowly_gets_a_400_at_the_deadline(server):
    engine = engine_process(server.proc.pid)
    assert httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "guided_regex": "[ab]+"},
                      timeout=60).status_code == 200   # the workers are started
    start = time.monotonic()
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "guided_regex": SLOW_REGEX}, timeout=120)
    took = time.monotonic() - start
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == ("guided_regex", "grammar_too_complex", "invalid_request_error")
    assert "--timeout-grammar-compile" in err["message"]
    assert took < 30
    # the killed compile is gone, the engine is not: at most the two workers and the engine remain
    assert len(spawned_children(server.proc.pid)) <= 3 and engine in spawned_children(server.proc.pid)
    server.wait_idle()


def test_slow_specs_do_not_starve_other_structured_requests_or_streams(server):
    statuses: list[int] = []

    def slow(i: int) -> None:
        body = {**CHAT, "guided_regex": "ab"[i % 2] + SLOW_REGEX}   # each its own spec: no cache helps
        statuses.append(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).status_code)

    hogs = [threading.Thread(target=slow, args=(i,)) for i in range(4)]
    for t in hogs:
        t.start()
    time.sleep(0.5)
    # a plain stream flows meanwhile, and a structured request is answered once two deadlines pass
    stream = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "A list", "max_tokens": 20,
                                                              "stream": True}, timeout=30)
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    start = time.monotonic()
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "guided_choice": ["yes", "no"]}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    assert time.monotonic() - start < 60
    for t in hogs:
        t.join()
    assert statuses == [400] * 4
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    server.wait_idle()


def test_a_spec_known_to_compile_does_not_wait_behind_slow_ones(server):
    known = {**CHAT, "response_format": {"type": "json_object"}}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=known, timeout=60).status_code == 200
    statuses: list[int] = []

    def slow(i: int) -> None:
        body = {**CHAT, "guided_regex": f"c{i}" + SLOW_REGEX}
        statuses.append(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).status_code)

    # eight specs of two deadlines (2 s) each hold the two workers for ~8 s, first come, first served
    hogs = [threading.Thread(target=slow, args=(i,)) for i in range(8)]
    for t in hogs:
        t.start()
    time.sleep(0.5)
    start = time.monotonic()
    r = httpx.post(f"{server.url}/v1/chat/completions", json=known, timeout=120)
    took = time.monotonic() - start
    assert r.status_code == 200, r.text
    assert took < 3, f"a spec that compiled before waited {took:.1f} s for a worker"
    for t in hogs:
        t.join()
    assert statuses == [400] * 8
    server.wait_idle()


def test_specs_whose_clients_left_stop_holding_the_compile_workers(server):
    assert httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "guided_regex": "[cd]+"},
                      timeout=60).status_code == 200   # the workers are started

    def abandon(i: int, stream: bool) -> None:
        body = {**CHAT, "guided_regex": f"d{i}" + SLOW_REGEX, "stream": stream}
        with pytest.raises(httpx.ReadTimeout):   # the client gives up long before the deadline
            httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=0.5)

    # twelve specs of one deadline (2 s) each would hold the two workers for ~12 s after their
    # clients left; a client still there must not wait behind them
    gone = [threading.Thread(target=abandon, args=(i, i % 2 == 0)) for i in range(12)]
    for t in gone:
        t.start()
    for t in gone:
        t.join()
    start = time.monotonic()
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "guided_choice": ["left", "right"]},
                   timeout=120)
    took = time.monotonic() - start
    assert r.status_code == 200, r.text
    assert took < 6, f"a new spec waited {took:.1f} s behind specs whose clients had left"
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    server.wait_idle()
