"""`serve --api-server-count 2`: two front-end processes on one port and one engine core. Requests on
either reach the core and come back whole; /metrics shows the whole server from either; admission
counts the other front end's sequences; a stop drains both; any death stops the server non-zero."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import (DEVICE, REPO, SERVER_ARGS, ServerProcess, free_port, gone_within, metrics_text,
                                   spawned_children)

PROMPTS = [f"Item {i}: the weather in town number {i} is" for i in range(12)]


def _listening_inode(port: int) -> str:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":   # 0A: LISTEN
                return fields[9]
    raise AssertionError(f"nothing listens on port {port}")


def logged_by_both(proc: ServerProcess, line: str, timeout: float) -> ServerProcess:
    """`proc` once its log holds `line` twice (once from each front end)."""
    deadline = time.monotonic() + timeout
    while proc.log_path.read_text(errors="replace").count(line) < 2:
        assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log_tail()
        time.sleep(0.01)
    return proc


def started(proc: ServerProcess, timeout: float = 120.0) -> ServerProcess:
    """`proc` once both front ends serve: /health answers as soon as the first does."""
    return logged_by_both(proc, "Application startup complete", timeout)


def processes(proc: ServerProcess) -> tuple[int, list[int]]:
    """The engine core and the front ends under the server's main process: the front ends are those
    that hold the listening socket."""
    inode = f"socket:[{_listening_inode(proc.port)}]"
    front_ends, others = [], []
    for pid in spawned_children(proc.proc.pid):
        fds = Path(f"/proc/{pid}/fd")
        holds = any(os.readlink(fd) == inode for fd in fds.iterdir() if fd.is_symlink())
        (front_ends if holds else others).append(pid)
    assert len(front_ends) == 2 and len(others) == 1, (front_ends, others)
    return others[0], front_ends


def _completion(url: str, prompt: str, stream: bool) -> str:
    # a client of its own for each request: a new connection, which either front end may take
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        if not stream:
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
        return "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True) if chunk.choices)


@pytest.fixture(scope="module")
def two_front_ends(server_model, tmp_path_factory):
    with ServerProcess(server_model, tmp_path_factory.mktemp("api-servers"), *SERVER_ARGS,
                       "--api-server-count", "2") as proc:
        yield started(proc)


def test_requests_on_either_front_end_come_back_whole_and_metrics_count_both(two_front_ends):
    proc = two_front_ends
    alone = {p: _completion(proc.url, p, stream=False) for p in PROMPTS[:3]}
    results: dict[tuple[str, bool], str] = {}
    threads = [threading.Thread(target=lambda p=p, s=s: results.__setitem__((p, s), _completion(proc.url, p, s)))
               for p in PROMPTS for s in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 2 * len(PROMPTS)
    for prompt in PROMPTS:   # a request's tokens went to the front end that asked, and nowhere else
        assert results[(prompt, False)] == results[(prompt, True)]
        assert results[(prompt, False)] == alone.get(prompt, results[(prompt, False)])
    log = proc.log_path.read_text(errors="replace")
    assert "[api 0] nanoserve.requests" in log and "[api 1] nanoserve.requests" in log
    sent = 3 + 2 * len(PROMPTS)
    for _ in range(4):   # whichever front end answers the scrape, it counts both
        m = proc.wait_idle()
        assert sum(v for k, v in _labelled(proc, "nanoserve:request_success_total").items()) == sent
        assert m["nanoserve:kv_cache_blocks_in_use"] == 0


def _labelled(proc: ServerProcess, name: str) -> dict[str, float]:
    text = metrics_text(proc.url)
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name)}


def _stream(url: str, prompt: str, tokens: int, ends: dict) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        ends[prompt] = (r.status_code, events)
    except httpx.TransportError as exc:
        ends[prompt] = (None, repr(exc))


def _admitted(proc: ServerProcess) -> float:
    m = proc.metrics()
    return m["nanoserve:num_requests_running"] + m["nanoserve:num_requests_waiting"]


def streaming(proc: ServerProcess, name: str, count: int, tokens: int) -> tuple[list[threading.Thread], dict]:
    """`count` streams of `tokens` tokens each, once the core holds them all: their threads, and
    where each puts its (status, events) under its prompt."""
    ends: dict = {}
    streams = [threading.Thread(target=_stream, args=(proc.url, f"{name} {i}", tokens, ends)) for i in range(count)]
    for t in streams:
        t.start()
    deadline = time.monotonic() + 60
    while _admitted(proc) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return streams, ends


def test_admission_counts_the_other_front_ends_sequences(server_model, tmp_path):
    # room for 2 running + 2 waiting in the whole server, not in each front end
    with ServerProcess(server_model, tmp_path, *SERVER_ARGS[:4], "--max-num-seqs", "2", "--max-queue-len", "2",
                       "--api-server-count", "2") as proc:
        started(proc)
        streams, ends = streaming(proc, "Long", 4, 400)
        refused = [httpx.post(f"{proc.url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=30)
                   for _ in range(8)]
        assert [r.status_code for r in refused] == [503] * 8, [r.text for r in refused]
        assert all(r.json()["error"]["code"] == "queue_full" for r in refused)
        for t in streams:
            t.join(120)
        assert all(code == 200 and events[-1] == "data: [DONE]" for code, events in ends.values())
        assert proc.wait_idle()["nanoserve:kv_cache_blocks_in_use"] == 0
        # a burst on an idle server, each request on a connection of its own (both front ends get
        # some): the core's stats said 0 in each, and each front end admitted 4
        body = {"prompt": "Burst", "max_tokens": 64, "ignore_eos": True}
        codes: list[int] = []
        burst = [threading.Thread(target=lambda: codes.append(
            httpx.post(f"{proc.url}/v1/completions", json=body, timeout=120).status_code)) for _ in range(16)]
        for t in burst:
            t.start()
        for t in burst:
            t.join(150)
        assert len(codes) == 16 and set(codes) <= {200, 503}
        assert 1 <= codes.count(200) <= 4, codes
        assert proc.wait_idle()["nanoserve:kv_cache_blocks_in_use"] == 0


def test_sigterm_drains_both_front_ends_and_every_process_exits_zero(server_model, tmp_path):
    proc = started(ServerProcess(server_model, tmp_path, *SERVER_ARGS, "--api-server-count", "2"))
    core, front_ends = processes(proc)
    streams, ends = streaming(proc, "Drain", 6, 300)
    proc.proc.send_signal(signal.SIGTERM)
    for t in streams:
        t.join(120)
    assert proc.proc.wait(60) == 0, proc.log_tail()
    for code, events in ends.values():   # each stream finished: a drain, not a cut
        assert code == 200 and events[-1] == "data: [DONE]", events[-2:] if code else events
        assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert gone_within([core, *front_ends], 10)
    proc.stop()


@pytest.mark.parametrize("count", ["1", "2"])
def test_sigterm_to_the_whole_process_group_drains_as_sigterm_to_the_server(server_model, tmp_path, count):
    # a service manager's stop (systemd's default, `timeout`) signals every process of the group:
    # the engine core and its workers must wait to be told, not die under the requests being drained
    proc = ServerProcess(server_model, tmp_path, *SERVER_ARGS, "--api-server-count", count, new_session=True)
    try:
        if count == "2":
            started(proc)
        streams, ends = streaming(proc, "Group", 4, 300)
        os.killpg(proc.proc.pid, signal.SIGTERM)
        for t in streams:
            t.join(120)
        assert proc.proc.wait(60) == 0, proc.log_tail(20000)
        assert all(code == 200 and events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
                   for code, events in ends.values()), ends
    finally:
        proc.stop()


@pytest.mark.parametrize("stop", ["SIGTERM to the main process", "Ctrl-C to the process group"])
def test_a_stop_while_the_processes_start_is_a_clean_stop(server_model, tmp_path, stop):
    # Ctrl-C reaches every process of the group: a child still importing died of it ("Fatal Python
    # error: init_import_site", or killed by SIGINT), and the server exited 1 blaming the engine core
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", server_model, "--host", "127.0.0.1",
                                   "--port", str(free_port()), "--device", DEVICE, *SERVER_ARGS, "--api-server-count",
                                   "2"], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                  env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while len(spawned_children(server.pid)) < 3:   # the core and both front ends, still importing
                assert time.monotonic() < deadline and server.poll() is None, log.read_text()
                time.sleep(0.01)
            children = spawned_children(server.pid)
            if stop.startswith("SIGTERM"):
                server.send_signal(signal.SIGTERM)
            else:
                os.killpg(server.pid, signal.SIGINT)
            assert server.wait(60) == 0, log.read_text()
            assert gone_within(children, 10)
        finally:
            server.kill()


@pytest.mark.parametrize("target, count", [("main", 2), ("group", 3)])
def test_repeated_sigints_force_the_stop_with_an_openai_error_whoever_gets_them(server_model, tmp_path, target, count):
    # a SIGINT sent to the main process alone reached the front ends as SIGTERM, which only drains:
    # the second never forced the stop. A Ctrl-C to the group reaches the front ends twice (their
    # own and the main process's forward) and must not count twice either: two force with the grace.
    # A third comes once the streams have their error (a Ctrl-C 0.3 s later forces the stop at once,
    # and on a loaded machine may cut a stream before its handler ran): it must not change the verdict
    proc = started(ServerProcess(server_model, tmp_path, *SERVER_ARGS, "--api-server-count", "2",
                                 new_session=True))
    try:
        streams, ends = streaming(proc, "Stop", 4, 1500)   # a drain would take them far longer than the test
        for sent in range(count):
            if sent == 2:
                deadline = time.monotonic() + 30
                while len(ends) < 4 and time.monotonic() < deadline:
                    time.sleep(0.01)
            with contextlib.suppress(ProcessLookupError):   # the server may be gone by a late one
                if target == "main":
                    proc.proc.send_signal(signal.SIGINT)
                else:
                    os.killpg(proc.proc.pid, signal.SIGINT)
            time.sleep(0.3)
        assert proc.proc.wait(30) == 1, proc.log_tail()   # the verdict stands, even for a late Ctrl-C
        for t in streams:
            t.join(30)
        assert len(ends) == 4
        for code, events in ends.values():
            assert code == 200 and events[-1] == "data: [DONE]", events[-2:] if code else events
            assert json.loads(events[-2][len("data: "):])["error"]["code"] == "engine_dead"
    finally:
        proc.stop()


def test_a_front_ends_own_sigint_beside_the_forwarded_sigterm_only_drains(server_model, tmp_path):
    # a Ctrl-C to the group reaches each front end twice, its own SIGINT and the supervisor's SIGTERM,
    # in either order: a SIGINT after the SIGTERM read as a second Ctrl-C and forced the stop at once
    proc = started(ServerProcess(server_model, tmp_path, *SERVER_ARGS, "--api-server-count", "2"))
    try:
        streams, ends = streaming(proc, "Drain", 4, 200)   # seconds, well inside the drain's 30
        _, front_ends = processes(proc)
        proc.proc.send_signal(signal.SIGTERM)   # forwarded to each front end
        logged_by_both(proc, "Shutting down", 30)   # the SIGTERM taken first: both front ends drain
        for pid in front_ends:
            os.kill(pid, signal.SIGINT)
        for t in streams:
            t.join(120)
        assert len(ends) == 4
        for code, events in ends.values():
            assert code == 200 and events[-1] == "data: [DONE]", events[-2:] if code else events
            last = json.loads(events[-2][len("data: "):])
            assert "error" not in last and last["choices"][0]["finish_reason"] == "length", last
        assert proc.proc.wait(60) == 0, proc.log_tail()
    finally:
        proc.stop()


def test_a_front_end_that_stops_unasked_stops_the_server_non_zero_even_when_it_exits_0(server_model, tmp_path):
    # a SIGTERM sent to one front end alone drains it to a clean exit: the server stopped, and
    # exited 0, so a service manager's restart-on-failure left it down
    proc = started(ServerProcess(server_model, tmp_path, *SERVER_ARGS, "--api-server-count", "2"))
    try:
        _, front_ends = processes(proc)
        os.kill(front_ends[0], signal.SIGTERM)
        assert proc.proc.wait(60) == 1, proc.log_tail()
        assert "exited with code 0; stopping the server" in proc.log_tail()
    finally:
        proc.stop()


def test_a_front_end_that_dies_stops_the_whole_server_non_zero(server_model, tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = started(ServerProcess(server_model, tmp_path, *SERVER_ARGS, "--api-server-count", "2",
                                 env={"TMPDIR": str(temp)}))
    try:
        core, front_ends = processes(proc)
        os.kill(front_ends[0], signal.SIGKILL)
        assert proc.proc.wait(60) != 0
        assert gone_within([core, *front_ends], 10)
        assert "Front end nanoserve-api-" in proc.log_path.read_text(errors="replace")
        # the main process removes the sockets and metrics it made; a front end makes no files of its own
        assert list(temp.iterdir()) == []
    finally:
        proc.stop()


def test_killing_the_engine_fails_streams_on_both_front_ends_then_the_server_exits_non_zero(server_model, tmp_path):
    proc = ServerProcess(server_model, tmp_path, *SERVER_ARGS, "--api-server-count", "2",
                         "--engine-death-grace-period", "3")
    try:
        started(proc)
        core, front_ends = processes(proc)
        streams, ends = streaming(proc, "Doomed", 8, 1500)
        killed = time.monotonic()
        os.kill(core, signal.SIGKILL)
        for t in streams:
            t.join(30)
        assert time.monotonic() - killed < 10
        for code, events in ends.values():   # each front end learned of the death from the core's pid
            errors = [json.loads(e[len("data: "):]) for e in events if '"error"' in e]
            assert code == 200 and errors and errors[-1]["error"]["code"] == "engine_dead", events[-2:]
        health = httpx.get(f"{proc.url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert proc.proc.wait(60) != 0
        assert gone_within(front_ends, 10)
    finally:
        proc.stop()


def test_api_server_count_out_of_bounds_is_refused_before_the_model_loads(monkeypatch, capsys):
    from tests.server.conftest import serve_refusal

    for count in ("0", "-1", "65"):
        assert "--api-server-count must be 1-64" in serve_refusal(monkeypatch, capsys, "--api-server-count", count)


@pytest.mark.parametrize("count", ["1", "2"])
def test_a_temporary_folder_too_deep_for_a_socket_path_still_serves_and_is_left_clean(server_model, tmp_path, count):
    # a socket's path has at most 107 bytes: under a TMPDIR this deep (a CI or batch job's own) the
    # engine's ZeroMQ sockets could not bind, and the server failed with a traceback, leaving its folder
    temp = tmp_path / ("t" * 90)
    temp.mkdir()
    proc = ServerProcess(server_model, tmp_path, *SERVER_ARGS, "--api-server-count", count, env={"TMPDIR": str(temp)})
    try:
        if count == "2":
            started(proc)
        serves_and_leaves_clean(proc, temp)
    finally:
        proc.stop()


def serves_and_leaves_clean(proc: ServerProcess, temp: Path) -> None:
    """`proc` answers a completion, stops with exit 0, and leaves nothing in its temporary folder."""
    reply = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert proc.stop() == 0, proc.log_tail()
    assert list(temp.iterdir()) == []


def test_a_killed_servers_socket_folder_is_removed_by_the_next_server(server_model, tmp_path):
    # a server killed outright (SIGKILL, the OOM killer) cannot remove its folder of ipc sockets; it
    # stayed in the temporary folder for good. The next server removes it, and only it (the folders
    # of --api-server-count N are made and removed by the same functions: engine/ipc_dir.py)
    temp = tmp_path / "tmp"
    temp.mkdir()
    killed = ServerProcess(server_model, tmp_path, *SERVER_ARGS, env={"TMPDIR": str(temp)})
    try:
        children = spawned_children(killed.proc.pid)
        left = list(temp.iterdir())
        assert len(left) == 1 and (left[0] / "lock").exists()
        killed.proc.send_signal(signal.SIGKILL)
        killed.proc.wait(10)
        assert gone_within(children, 10)
        assert list(temp.iterdir()) == left
    finally:
        killed.stop()
    following = ServerProcess(server_model, tmp_path, *SERVER_ARGS, env={"TMPDIR": str(temp)})
    try:
        now = list(temp.iterdir())
        assert len(now) == 1 and now != left
        serves_and_leaves_clean(following, temp)
    finally:
        following.stop()
