"""`serve --uds PATH`: the server listens on a Unix domain socket instead of a TCP port (vLLM's flag),
for a proxy or sidecar on the same machine. A dead server's socket file is taken over, a live
server's or a file that is not a socket is refused, and a stop removes the file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import DEVICE, REPO, SERVER_ARGS


def _serve(model: str, path: Path, log: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", model, "--uds", str(path), "--device",
                             DEVICE, "--served-model-name", "tiny", *SERVER_ARGS, *args],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def _client(path: Path) -> httpx.Client:
    # a request that never comes back still fails; one slowed by the other test process's load does
    # not (once, in the full suite, a two-front-end server's first answer took more than 30 s)
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://nanoserve", timeout=120)


def _wait_healthy(server: subprocess.Popen, path: Path, log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()
        try:
            with _client(path) as client:
                if client.get("/health").status_code == 200:
                    return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(log.read_text())


@pytest.mark.parametrize("count", ["1", "2"])
def test_serves_the_openai_client_on_a_unix_socket_and_removes_it_on_stop(server_model, tmp_path, count):
    path, log = tmp_path / "nanoserve.sock", tmp_path / "server.log"
    # a dead server's socket file: bound, never unlinked
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    server = _serve(server_model, path, log, "--api-server-count", count)
    try:
        _wait_healthy(server, path, log)
        with openai.OpenAI(base_url="http://nanoserve/v1", api_key="none", max_retries=0,
                           http_client=_client(path)) as client:
            try:
                whole = client.completions.create(model="tiny", prompt="The weather", max_tokens=12, temperature=0)
                streamed = "".join(c.choices[0].text for c in client.completions.create(
                    model="tiny", prompt="The weather", max_tokens=12, temperature=0, stream=True) if c.choices)
            except openai.APIError as exc:   # what the server's processes said meanwhile
                raise AssertionError(log.read_text()[-20000:]) from exc
            assert whole.choices[0].text == streamed and whole.usage.completion_tokens > 0
        # another server on the same path is refused at once, before its model loads
        second = subprocess.run([sys.executable, "-m", "nanoserve.cli", "serve", server_model, "--uds", str(path),
                                 "--device", DEVICE], capture_output=True, text=True, cwd=REPO, timeout=120,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        assert second.returncode != 0 and "another server answers there" in second.stderr
        with _client(path) as http:
            assert http.get("/health").status_code == 200   # and the first one still serves
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, log.read_text()
        assert not path.exists()
    finally:
        server.kill()


def test_a_path_that_is_not_a_socket_is_refused(server_model, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    done = subprocess.run([sys.executable, "-m", "nanoserve.cli", "serve", server_model, "--uds", str(path),
                           "--device", DEVICE], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode != 0 and "exists and is not a socket" in done.stderr
    assert path.read_text() == "keep me"
    too_long = tmp_path / ("x" * 120)
    done = subprocess.run([sys.executable, "-m", "nanoserve.cli", "serve", server_model, "--uds", str(too_long),
                           "--device", DEVICE], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode != 0 and "cannot listen on" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("where", ["uds", "port"])
def test_a_second_server_is_refused_while_the_first_still_loads(tmp_path, where):
    # the first server holds its socket from before its model loads; a second one started then must
    # be refused at once: on a Unix socket it took the path over as a dead server's (the first then
    # served on a file no one could reach, and removed the second's on exit), on a port it loaded its
    # model and only then failed to listen
    from nanoserve.server.listen import bind_socket
    from tests.server.conftest import free_port

    path, port = str(tmp_path / "loading.sock"), free_port()
    first = bind_socket("127.0.0.1", port, path if where == "uds" else None)
    try:
        with pytest.raises(SystemExit, match="cannot listen on"):
            bind_socket("127.0.0.1", port, path if where == "uds" else None).close()
        if where == "uds":   # the path still reaches the first server
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect(path)
                first.settimeout(5)
                first.accept()[0].close()
    finally:
        first.close()


@pytest.mark.parametrize("where", ["uds", "port"])
def test_a_busy_socket_is_refused_before_the_engine_process_starts(tmp_path, monkeypatch, where):
    # the refusal came only after the web stack had loaded, with the engine's process started (seconds)
    import nanoserve.engine.early_start
    from nanoserve.cli import main
    from nanoserve.server.listen import bind_socket
    from tests.server.conftest import free_port

    def no_engine() -> None:
        raise AssertionError("the engine's process started before the socket was taken")

    monkeypatch.setattr(nanoserve.engine.early_start, "EarlyEngineProcess", no_engine)
    path, port = str(tmp_path / "busy.sock"), free_port()
    first = bind_socket("127.0.0.1", port, path if where == "uds" else None)
    try:
        with pytest.raises(SystemExit, match="cannot listen on"):
            main(["serve", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
                  *(["--uds", path] if where == "uds" else [])])
    finally:
        first.close()


def test_an_empty_path_is_refused_before_the_model_loads(monkeypatch, capsys):
    # an unset variable spliced in (--uds "$SOCK"): Linux binds an empty path to a random abstract
    # address, and the server served where no client could find it
    from tests.server.conftest import serve_refusal

    assert "--uds" in serve_refusal(monkeypatch, capsys, "--uds", "")
