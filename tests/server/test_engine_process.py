"""The engine core in its own process: its death fails every stream at once and turns /health to
503, the server then exits non-zero; the front end's death takes the engine with it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import REPO, SERVER_ARGS, ServerProcess, engine_process, gone_within, spawned_children


def _stream_until_end(url: str, index: int, started: threading.Barrier, ends: dict) -> None:
    # every other stream is a Responses API one, whose error is an event of type "error"
    path, body = (("/v1/responses", {"input": f"A list of {index}", "max_output_tokens": 1500}) if index % 2
                  else ("/v1/completions", {"prompt": f"A list of {index}", "max_tokens": 1500}))
    last = None
    try:
        with httpx.stream("POST", f"{url}{path}", json={**body, "ignore_eos": True, "stream": True},
                          timeout=60) as response:
            lines = (line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))
            next(lines)
            started.wait(30)
            for last in lines:
                event = json.loads(last) if last != "[DONE]" else {}
                if "error" in event or event.get("type") == "error":
                    ends.setdefault(index, (time.monotonic(), event.get("error", event)))
    except httpx.TransportError as exc:
        ends[index] = (time.monotonic(), repr(exc))
    ends.setdefault(index, (time.monotonic(), f"ended without an error, last event {last!r}"))


def test_killing_the_engine_fails_every_stream_within_5s_then_the_server_exits_non_zero(server_model, tmp_path):
    proc = ServerProcess(server_model, tmp_path, *SERVER_ARGS, "--engine-death-grace-period", "4")
    try:
        engine = engine_process(proc.proc.pid)
        started, ends = threading.Barrier(17), {}
        threads = [threading.Thread(target=_stream_until_end, args=(proc.url, i, started, ends)) for i in range(16)]
        for t in threads:
            t.start()
        started.wait(60)  # all 16 are streaming
        killed = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert len(ends) == 16
        for when, error in ends.values():
            assert when - killed < 5.0
            assert isinstance(error, dict) and error["code"] == "engine_dead", error
        health = httpx.get(f"{proc.url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        late = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
        metrics = proc.metrics()  # nothing runs any more: no stale gauges from before the death
        assert metrics["nanoserve:engine_alive"] == 0 and metrics["nanoserve:num_requests_running"] == 0
        assert metrics["nanoserve:kv_cache_blocks_in_use"] == 0
        assert proc.proc.poll() is None  # still up, to say so
        # after the grace period it exits non-zero, for its supervisor to restart it
        assert proc.proc.wait(30) != 0
        assert "The engine process was killed by SIGKILL" in proc.log_path.read_text(errors="replace")
    finally:
        proc.stop()


@pytest.mark.parametrize("order", ["sigterm_then_engine_dies", "engine_dies_then_sigterm"])
def test_an_engine_death_before_the_server_stops_makes_its_exit_non_zero(server_model, tmp_path, order):
    # serve exits non-zero "if the engine died": but a SIGTERM within the grace period (a
    # supervisor's, once /health said 503) or an engine death during the drain exited 0, as a clean stop
    proc = ServerProcess(server_model, tmp_path, *SERVER_ARGS, "--shutdown-timeout", "60",
                         "--engine-death-grace-period", "60")
    try:
        engine = engine_process(proc.proc.pid)
        started, ends = threading.Barrier(2), {}
        stream = threading.Thread(target=_stream_until_end, args=(proc.url, 0, started, ends))
        stream.start()
        started.wait(60)   # streaming: the drain waits for it
        stop, kill = (lambda: proc.proc.send_signal(signal.SIGTERM)), (lambda: os.kill(engine, signal.SIGKILL))
        if order == "sigterm_then_engine_dies":
            stop()
            kill()
        else:
            kill()
            stream.join(30)   # the engine's death has reached the stream: the server knows of it
            stop()
        stream.join(30)
        assert ends[0][1]["code"] == "engine_dead", ends
        assert proc.proc.wait(30) != 0
    finally:
        proc.stop()


def test_a_stuck_engine_turns_health_to_503_until_it_speaks_again(server_model, tmp_path):
    """A step that never returns is stood in for by SIGSTOP: the heartbeat stops, and /health says
    so once --engine-stall-timeout passes; the cache's size is on /metrics from the start."""
    with ServerProcess(server_model, tmp_path, *SERVER_ARGS, "--engine-stall-timeout", "3") as proc:
        assert proc.metrics()["nanoserve:kv_cache_blocks_total"] == 512   # before any request
        time.sleep(4)   # idle is not stalled: the heartbeat goes on
        assert httpx.get(f"{proc.url}/health", timeout=5).status_code == 200
        engine = engine_process(proc.proc.pid)
        os.kill(engine, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 15
            while (health := httpx.get(f"{proc.url}/health", timeout=5)).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_stalled", health.text
            ping = httpx.post(f"{proc.url}/ping", timeout=5)   # vLLM's probe says the same
            assert ping.status_code == 503 and ping.json()["error"]["code"] == "engine_stalled", ping.text
        finally:
            os.kill(engine, signal.SIGCONT)
        deadline = time.monotonic() + 10   # the next heartbeat clears it
        while httpx.get(f"{proc.url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "/health stayed 503 after the engine spoke again"
            time.sleep(0.1)
        r = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "A list", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200


def test_sigkill_of_the_front_end_takes_the_engine_process_with_it(server_model, tmp_path):
    proc = ServerProcess(server_model, tmp_path, *SERVER_ARGS, "--disable-log-requests")
    try:
        engine = engine_process(proc.proc.pid)
        body = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30).json()
        assert body["choices"] and body["id"] not in proc.log_tail(200_000)  # no request log lines
        proc.proc.kill()
        proc.proc.wait(10)
        assert gone_within([engine], 5), "the engine process outlived its front end"
    finally:
        proc.stop()


def test_sigkill_of_the_engine_takes_its_tensor_parallel_worker_with_it(server_model, tmp_path):
    proc = ServerProcess(server_model, tmp_path, *SERVER_ARGS, "--tensor-parallel-size", "2")
    try:
        engine = engine_process(proc.proc.pid)
        (worker,) = spawned_children(engine)
        os.kill(engine, signal.SIGKILL)
        assert gone_within([worker], 5), "the tensor-parallel worker outlived its engine"
    finally:
        proc.stop()


def test_an_engine_that_cannot_load_its_model_makes_serve_exit_non_zero_naming_why(server_model, tmp_path):
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "no-weights"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(server_model) / name, folder / name)
    done = subprocess.run([sys.executable, "-m", "nanoserve.cli", "serve", str(folder), "--host", "127.0.0.1",
                           "--port", "0", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "No *.safetensors files" in done.stderr


def test_the_server_and_its_engine_core_freeze_their_startup_heaps(server_model, tmp_path):
    # every full collection walked what startup built (the tokenizer's vocabulary, modules): 150 ms
    # pauses in the front end under prompt logprobs. A sitecustomize notes each gc.freeze() and what it froze.
    site = tmp_path / "site"
    site.mkdir()
    marks = tmp_path / "freezes.txt"
    (site / "sitecustomize.py").write_text(
        "import gc, os\n"
        "_freeze = gc.freeze\n"
        "def _noted():\n"
        "    _freeze()\n"
        f"    with open({str(marks)!r}, 'a') as f:\n"
        "        f.write(f'{os.getpid()} {gc.get_freeze_count()}\\n')\n"
        "gc.freeze = _noted\n")
    with ServerProcess(server_model, tmp_path, env={"PYTHONPATH": f"{REPO}{os.pathsep}{site}"}) as proc:
        engine = engine_process(proc.proc.pid)
        frozen = dict(line.split() for line in marks.read_text().splitlines())
        assert set(frozen) == {str(proc.proc.pid), str(engine)}
        assert all(int(count) > 10_000 for count in frozen.values())
