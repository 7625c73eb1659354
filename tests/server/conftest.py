"""Real `nanoserve serve` processes on 127.0.0.1, one per test module or session, and their clients."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from nanoserve.config import DEFAULT_MODEL

REPO = Path(__file__).resolve().parents[2]
# CI runs these on the CPU; NANOSERVE_TEST_DEVICE=cuda runs the same tests on a GPU
DEVICE = os.environ.get("NANOSERVE_TEST_DEVICE", "cpu")
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
          "{%- endif %}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # a hung server must fail its test, not stall CI: no server test needs anywhere near this long
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(300))


def _chat_model(folder: Path) -> str:
    """A random-weight Qwen3 with a ChatML tokenizer: the stand-in when the bundled model is absent."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen3Config

    from tests.conftest import TINY_TEXT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TINY_TEXT], trainers.BpeTrainer(
        vocab_size=360, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                     additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    hf_tok.chat_template = CHATML
    hf_tok.save_pretrained(folder)
    config = Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    model.generation_config = GenerationConfig(eos_token_id=[0, 2], bos_token_id=0, pad_token_id=0)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def server_model(tmp_path_factory) -> str:
    """The bundled model, as the issue asks; a random stand-in only where the package lacks it."""
    if os.path.exists(os.path.join(DEFAULT_MODEL, "config.json")):
        return DEFAULT_MODEL
    warnings.warn(f"{DEFAULT_MODEL} is missing: the server tests run on a random-weight stand-in", stacklevel=1)
    return _chat_model(tmp_path_factory.mktemp("chat-model"))


def children(pid: int) -> list[int]:
    """Process ids whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def spawned_children(pid: int) -> list[int]:
    """The multiprocessing children of `pid` (the engine core, tensor-parallel workers), not its
    resource tracker."""
    return [child for child in children(pid) if "spawn_main" in Path(f"/proc/{child}/cmdline").read_text()]


def engine_process(server_pid: int) -> int:
    """The engine core: the server's one multiprocessing child."""
    found = spawned_children(server_pid)
    assert len(found) == 1, f"expected one engine process under the server, found {found}"
    return found[0]


def gone_within(pids: list[int], seconds: float) -> bool:
    """Whether every process in `pids` has exited (a zombie counts as gone) within `seconds`."""
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(pid) for pid in pids)


@contextmanager
def in_process_server(app) -> Iterator[tuple[str, threading.Thread]]:
    """uvicorn serving `app` (an ASGI app) on 127.0.0.1 in a thread of this process: its URL and
    the thread its event loop runs on, for tests that patch the engine or wrap the app."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.config.port}", thread
    finally:
        server.should_exit = True
        thread.join(30)


def calling_threads(monkeypatch, owner, name: str) -> list[threading.Thread]:
    """Patch owner.name to note the thread of each call to it: the list the notes go to."""
    seen: list[threading.Thread] = []
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args, **kwargs: seen.append(threading.current_thread())
                        or original(*args, **kwargs))
    return seen


def tiny_engine(model: str, blocks: int = 128):
    """An engine over `model` in this process, for a test to patch before serving it."""
    from nanoserve import EngineConfig
    from nanoserve.engine.async_engine import AsyncEngine

    return AsyncEngine(EngineConfig(model=model, device=DEVICE, num_kvcache_blocks=blocks, block_size=16))


@contextmanager
def serving(engine) -> Iterator[tuple[str, threading.Thread]]:
    """`engine` behind the app, served as "tiny" by in_process_server: its URL and loop thread."""
    from nanoserve.server.app import build_app
    from nanoserve.server.state import ServerSettings

    with in_process_server(build_app(engine, ServerSettings(served_model_names=["tiny"]))) as served:
        yield served


def serve_refusal(monkeypatch, capsys, *flags: str) -> str:
    """What `nanoserve serve --device cpu FLAGS` says on stderr as it exits 2, checked to be before
    the server (and so the model) starts."""
    import nanoserve.server.app
    from nanoserve.cli import main

    def no_serving(*args, **kwargs):
        raise AssertionError("the server started before the flags were checked")

    monkeypatch.setattr(nanoserve.server.app, "serve", no_serving)
    with pytest.raises(SystemExit) as exit_:
        # a free port of its own: a refusal that comes after the socket is taken (EngineConfig's) must
        # not find the default port held by another test process (the flags given come later and win)
        main(["serve", "--device", "cpu", "--host", "127.0.0.1", "--port", "0", *flags])
    assert exit_.value.code == 2
    return capsys.readouterr().err


_MODEL_LABEL = re.compile(r'\{model_name="[^"]*"\}|,model_name="[^"]*"')


def metrics_text(url: str, headers: dict[str, str] | None = None, **kwargs) -> str:
    """The server's /metrics without the model_name label that every series carries."""
    return _MODEL_LABEL.sub("", httpx.get(f"{url}/metrics", headers=headers, timeout=10, **kwargs).text)


def read_metrics(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """The samples of the server's /metrics with no label but the served model's, by name."""
    samples = {}
    for line in metrics_text(url, headers).splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _wait_until_admitted(url: str, requests: int, timeout: float = 30.0) -> None:
    """Until the server runs or queues `requests` requests (its /metrics gauges)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = read_metrics(url)
        if m["nanoserve:num_requests_running"] + m["nanoserve:num_requests_waiting"] >= requests:
            return
        time.sleep(0.02)
    raise AssertionError(f"the server did not admit {requests} requests in {timeout}s")


def interrupt_a_stream(url: str, body: dict, interrupt: Callable[[], None]) -> tuple[dict, list[str], httpx.Response]:
    """Stream `body` from /v1/completions beside the same request unstreamed; call `interrupt` once
    the first event is in. The first event, every event after it, and the unstreamed response."""
    whole: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: whole.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                     timeout=60)))
    waiter.start()
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        data = (line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))
        first = json.loads(next(data))
        _wait_until_admitted(url, 2)   # the unstreamed twin too, or an interrupt may come before it connects
        interrupt()
        rest = list(data)
    waiter.join(60)
    (unstreamed,) = whole
    return first, rest, unstreamed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m nanoserve.cli serve MODEL ...` on a free port, its output in a log file."""

    def __init__(self, model: str, log_dir: Path, *args: str, api_key: str | None = None,
                 env: dict[str, str] | None = None, verify: ssl.SSLContext | bool = True,
                 served_as: str | None = "tiny", new_session: bool = False) -> None:
        """verify: what httpx checks the server's certificate by, when args make it serve HTTPS;
        served_as: the --served-model-name (None: the server's default); new_session: the server
        leads a process group of its own (one that a test may signal whole)."""
        self.port = free_port()
        self.url = f"{'https' if '--ssl-certfile' in args else 'http'}://127.0.0.1:{self.port}"
        self.verify = verify
        self.api_key = api_key
        self.log_path = log_dir / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "nanoserve.cli", "serve", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--device", DEVICE, *args]
        if served_as is not None:
            cmd += ["--served-model-name", served_as]
        if api_key:
            cmd += ["--api-key", api_key]
        extra_env = env or {}
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("NANOSERVE_API_KEY", None)
        env.pop("VLLM_API_KEY", None)
        env.update(extra_env)
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     start_new_session=new_session)
        self.wait_ready()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nanoserve serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2, verify=self.verify).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"nanoserve serve did not become healthy in {timeout}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        return read_metrics(self.url, self.headers)

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Until nothing runs, waits, or holds a KV block; returns the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = (m["nanoserve:num_requests_running"], m["nanoserve:num_requests_waiting"],
                    m["nanoserve:kv_cache_blocks_in_use"])
            if busy == (0, 0, 0):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout}s: running, waiting, blocks = {busy}")
            time.sleep(0.05)


# small pool: 512 blocks of 16 tokens are plenty for the tests and keep the CPU KV cache at a few MB
SERVER_ARGS = ("--num-kvcache-blocks", "512", "--block-size", "16", "--max-num-seqs", "64")


@pytest.fixture(scope="session")
def server(server_model, tmp_path_factory):
    with ServerProcess(server_model, tmp_path_factory.mktemp("server-logs"), *SERVER_ARGS) as proc:
        yield proc


QWEN3_TEMPLATE = REPO / "tests" / "assets" / "chat_templates" / "qwen3.jinja"


@pytest.fixture(scope="session")
def tool_server(server_model, tmp_path_factory):
    """A server that parses tool calls (hermes) and reasoning (qwen3) under Qwen3's chat template."""
    with ServerProcess(server_model, tmp_path_factory.mktemp("tools"), "--num-kvcache-blocks", "256",
                       "--block-size", "16", "--chat-template", str(QWEN3_TEMPLATE), "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3") as proc:
        yield proc


@pytest.fixture(scope="session")
def offline(server_model):
    """The offline LLM on the same model and settings: the reference for the server's greedy outputs."""
    from nanoserve import LLM

    return LLM(server_model, device=DEVICE, num_kvcache_blocks=512, block_size=16, max_num_seqs=64)


# below the server's keep-alive timeout (5 s): a pooled connection the client reuses just as the
# server closes it for idling is "Server disconnected without sending a response", which these
# clients (no retries, so that no failure is hidden) would report as the test's failure
CLIENT_KEEPALIVE_S = 2.0


def openai_client(url: str, timeout: float = 120) -> openai.OpenAI:
    """The official client against a test server: no retries, idle connections dropped first by the client."""
    # the client's own transport's Limits (openai's, which need not be this httpx)
    limits = type(openai.DEFAULT_CONNECTION_LIMITS)(max_connections=100, max_keepalive_connections=20,
                                                    keepalive_expiry=CLIENT_KEEPALIVE_S)
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout,
                         http_client=openai.DefaultHttpxClient(limits=limits, timeout=timeout))

