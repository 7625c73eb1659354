"""The waiting-queue limit (503 with Retry-After) and SIGTERM letting requests in flight finish."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from nanoserve import SamplingParams
from tests.server.conftest import ServerProcess, engine_process, gone_within, interrupt_a_stream, spawned_children


@pytest.fixture
def limited(server_model, tmp_path):
    # one sequence at a time and room for two waiting: a burst must overflow
    with ServerProcess(server_model, tmp_path, "--max-queue-len", "2", "--max-num-seqs", "1",
                       "--num-kvcache-blocks", "128", "--block-size", "16") as proc:
        yield proc


def test_a_burst_past_the_queue_limit_gets_503s_and_the_admitted_all_complete(limited, offline):
    prompts = [f"A list of {i} items" for i in range(12)]
    refs = [o.text for o in offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                                      ignore_eos=True), use_tqdm=False)]

    async def main():
        async with httpx.AsyncClient(base_url=limited.url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json={
                "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}) for p in prompts))

    responses = asyncio.run(main())
    refused = [r for r in responses if r.status_code == 503]
    admitted = [(i, r) for i, r in enumerate(responses) if r.status_code == 200]
    assert len(refused) + len(admitted) == 12
    # one running (max_num_seqs 1) and two waiting (max_queue_len 2) fit: running and waiting are
    # counted apart, so the burst is not cut to the queue's length
    assert refused and len(admitted) >= 3
    for r in refused:
        # how long the queue takes to drain at the recent rate, jittered: refused clients spread out
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "max_queue_len 2" in r.json()["error"]["message"]
    for i, r in admitted:
        assert r.json()["choices"][0]["text"] == refs[i]
    limited.wait_idle()


def test_a_request_larger_than_the_server_ever_holds_names_n(limited):
    # one running plus two waiting is the most the server holds: n=4 can never be admitted
    chat = httpx.post(f"{limited.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "n": 4, "max_tokens": 2}, timeout=30)
    assert chat.status_code == 400
    error = chat.json()["error"]
    assert (error["param"], error["code"]) == ("n", "too_many_sequences") and "max_queue_len" in error["message"]
    two_prompts = httpx.post(f"{limited.url}/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2},
                             timeout=30)
    assert (two_prompts.status_code, two_prompts.json()["error"]["param"]) == (400, "prompt")
    limited.wait_idle()


def test_sigterm_lets_the_stream_in_flight_finish_then_exits(server_model, tmp_path, offline):
    # a deadline far beyond what 400 tokens take, even on a busy CI machine
    proc = ServerProcess(server_model, tmp_path, "--num-kvcache-blocks", "128", "--block-size", "16",
                         "--shutdown-timeout", "120")
    try:
        body = {"prompt": "A list", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{proc.url}/v1/completions", json=body, timeout=120) as response:
            data = (line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))
            first = next(data)
            proc.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.TransportError):  # no new connections while draining
                httpx.get(f"{proc.url}/health", timeout=2)
            rest = list(data)
        assert rest[-1] == "[DONE]"
        chunks = [json.loads(d)["choices"][0] for d in [first, *rest[:-1]]]
        assert chunks[-1]["finish_reason"] == "length"
        text = "".join(c["text"] for c in chunks)
        assert proc.proc.wait(30) == 0
        ref = offline.generate("A list", SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                               use_tqdm=False)[0].text
        assert text == ref  # all 400 tokens arrived
    finally:
        proc.stop()


def test_tensor_parallel_server_answers_like_offline_and_stops_its_worker(server_model, tmp_path, offline):
    proc = ServerProcess(server_model, tmp_path, "--num-kvcache-blocks", "512", "--block-size", "16",
                         "--max-num-seqs", "64", "--tensor-parallel-size", "2")
    try:
        engine = engine_process(proc.proc.pid)
        workers = spawned_children(engine)
        assert len(workers) == 1, "no tensor-parallel worker process under the server"
        ref = offline.generate("A list is", SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
        body = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "A list is", "max_tokens": 16,
                                                              "temperature": 0}, timeout=60).json()
        assert body["choices"][0]["text"] == ref.text
    finally:
        code = proc.stop()
    assert code == 0
    assert gone_within([workers[0], engine], 10)  # an orphan that has exited may wait a moment to be reaped


def test_requests_cut_by_the_shutdown_deadline_get_an_error_and_the_exit_code_says_so(server_model, tmp_path):
    proc = ServerProcess(server_model, tmp_path, "--num-kvcache-blocks", "256", "--block-size", "16",
                         "--shutdown-timeout", "3")
    try:
        body = {"prompt": "A list", "max_tokens": 1900, "temperature": 0, "ignore_eos": True}
        _, rest, response = interrupt_a_stream(proc.url, body, lambda: proc.proc.send_signal(signal.SIGTERM))
        # the stream ends with an error event and [DONE], not a cut connection
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "engine_dead" and "shut down" in error["message"]
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
        assert proc.proc.wait(30) != 0  # the drain did not complete
    finally:
        proc.stop()


def test_one_ctrl_c_stops_a_ready_server_cleanly(server_model, tmp_path):
    # uvicorn re-raised the SIGINT it had drained on to asyncio's handler: a KeyboardInterrupt
    # traceback, and the process died of the signal (130) where SIGTERM exits 0
    proc = ServerProcess(server_model, tmp_path)
    try:
        proc.proc.send_signal(signal.SIGINT)
        assert proc.proc.wait(30) == 0, proc.log_tail()
        assert "Traceback" not in proc.log_tail(100_000) and "Finished server process" in proc.log_tail()
    finally:
        proc.stop()


def test_a_second_sigint_ends_the_open_requests_with_an_openai_error_before_forcing_the_stop(server_model, tmp_path):
    # uvicorn's forced stop cancelled the handlers at once: whole responses got its plain-text 500
    proc = ServerProcess(server_model, tmp_path, "--num-kvcache-blocks", "256", "--block-size", "16")
    try:
        body = {"prompt": "A list", "max_tokens": 1900, "temperature": 0, "ignore_eos": True}

        def twice() -> None:
            proc.proc.send_signal(signal.SIGINT)   # a drain: the requests would take their time
            time.sleep(0.5)
            proc.proc.send_signal(signal.SIGINT)

        _, rest, response = interrupt_a_stream(proc.url, body, twice)
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "engine_dead" and "stopped before this request finished" in error["message"]
        assert response.status_code == 503 and response.headers["content-type"].startswith("application/json")
        assert response.json()["error"]["code"] == "engine_dead"
        assert proc.proc.wait(30) != 0   # the drain did not complete
    finally:
        proc.stop()
