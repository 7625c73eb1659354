"""How long garbage collection under prompt logprobs stalls a running server.

    python bench/prompt_logprobs_stall.py            # starts `nanoserve serve` itself

Starts the server (bundled model unless --model) with a `gc.callbacks` probe in each of its
processes, then sends one request of 16 prompts of 2,000 random token ids with prompt_logprobs 20
and max_tokens 1, three times, while /health is polled every 5 ms. Prints, per run, the request's
latency, the CPU time each process spent on it and the slowest /health, then the full collections
(generation 2) each process ran while the requests were served.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent

# imported by every Python process started with this folder on PYTHONPATH: the server's front end
# and its engine core alike, whichever way the latter is started
PROBE = """\
import gc, os, time
_out = os.environ.get("GC_PROBE_FILE")
if _out:
    _started = [0.0]
    def _probe(phase, info):
        if info["generation"] != 2:
            return
        if phase == "start":
            _started[0] = time.perf_counter()
            return
        with open(_out, "a") as f:
            f.write(f"{os.getpid()} {time.time():.4f} {1e3 * (time.perf_counter() - _started[0]):.2f}\\n")
    gc.callbacks.append(_probe)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def poll_health(client: httpx.AsyncClient, url: str, done: asyncio.Event, waits: list[float]) -> None:
    while not done.is_set():
        start = time.perf_counter()
        await client.get(f"{url}/health")
        waits.append(time.perf_counter() - start)
        await asyncio.sleep(0.005)


async def one_run(url: str, body: dict) -> tuple[float, float]:
    """(the request's latency, the slowest /health while it was served), in seconds."""
    async with httpx.AsyncClient(timeout=600) as client:
        done, waits = asyncio.Event(), []
        poller = asyncio.create_task(poll_health(client, url, done, waits))
        start = time.perf_counter()
        response = await client.post(f"{url}/v1/completions", json=body)
        latency = time.perf_counter() - start
        response.raise_for_status()
        done.set()
        await poller
    return latency, max(waits)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (Linux): unlike wall time, it does not grow
    while other work on the machine holds the cores."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (the engine core and anything it started)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *(p for child in children for p in process_tree(int(child)))]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the bundled model)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--top", type=int, default=20, help="prompt_logprobs of the request")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-kvcache-blocks", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=4096, help="random ids are drawn below this")
    args = parser.parse_args()

    rng = random.Random(0)
    body = {"prompt": [[rng.randrange(args.vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)],
            "max_tokens": 1, "prompt_logprobs": args.top, "temperature": 0}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(PROBE)
        probe_file = Path(tmp) / "collections.txt"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), tmp]), "GC_PROBE_FILE": str(probe_file)}
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "nanoserve", "serve", "--port", str(port),
                   "--num-kvcache-blocks", str(args.num_kvcache_blocks)]
        if args.model:
            command += ["--model", args.model]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_ready(url, proc)
            serving_since = time.time()
            engine = [p for p in process_tree(proc.pid) if p != proc.pid]
            for run in range(args.runs):
                before = cpu_seconds(proc.pid), sum(map(cpu_seconds, engine))
                latency, slowest = asyncio.run(one_run(url, body))
                front, core = cpu_seconds(proc.pid) - before[0], sum(map(cpu_seconds, engine)) - before[1]
                print(f"run {run + 1}: request {latency:.2f} s (CPU: front end {front:.2f} s, engine core {core:.2f} s), "
                      f"slowest /health {1e3 * slowest:.1f} ms")
            lines = probe_file.read_text().split("\n") if probe_file.exists() else []
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    by_process: dict[str, list[float]] = {}
    for line in filter(None, lines):
        pid, when, ms = line.split()
        if float(when) >= serving_since:
            name = "front end" if int(pid) == proc.pid else "engine core"
            by_process.setdefault(name, []).append(float(ms))
    for name in ("front end", "engine core"):
        times = sorted(by_process.get(name, []), reverse=True)
        shown = ", ".join(f"{t:.1f}" for t in times[:8])
        print(f"{name}: {len(times)} full collections while serving; slowest (ms): {shown or 'none'}")


if __name__ == "__main__":
    main()
