"""How much a server's front end holds for clients that read slowly, and what that does to a neighbour.

Opens `--streams` streamed chat requests on raw sockets with a small receive buffer, each reading one
byte every `--trickle-s` seconds, while one normal client streams short requests one after another.
Prints the front end's RSS (before, peak, at the end), how many trickling streams the server ended,
and the neighbour's latencies. Against a running server:

    python -m nanoserve serve --device cpu --num-kvcache-blocks 8192 --port 8011 &
    python scripts/slow_readers.py --port 8011 --pid $!
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def open_trickler(port: int, tokens: int, top_logprobs: int, echo: int) -> socket.socket:
    if echo:   # a prompt of `echo` tokens echoed with its logprobs to 8 choices: ~4.5 KB a prompt token at once
        path = b"/v1/completions"
        body = {"prompt": [100 + i % 200 for i in range(echo)], "n": 8, "echo": True, "logprobs": top_logprobs,
                "max_tokens": tokens, "ignore_eos": True, "stream": True}
    else:
        path = b"/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "Tell me about lists."}], "max_tokens": tokens,
                "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": top_logprobs}
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # the client's kernel takes little of it
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (path, len(data)) + data)
    sock.settimeout(0.01)
    return sock


def trickle(socks: list[socket.socket], period: float, stop: threading.Event) -> None:
    """One byte from each open socket every `period` seconds."""
    while not stop.is_set():
        for sock in socks:
            if sock.fileno() < 0:
                continue
            try:
                if sock.recv(1) == b"":
                    sock.close()
            except TimeoutError:
                pass
            except OSError:
                sock.close()
        stop.wait(period)


def neighbour(url: str, stop: threading.Event, latencies: list[tuple[float, float]], failures: list[str]) -> None:
    """Short streamed requests one after another: (when each ended, its latency)."""
    body = {"prompt": "A list is", "max_tokens": 32, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            start = time.monotonic()
            try:
                with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    done = any(line == "data: [DONE]" for line in r.iter_lines())
                latencies.append((time.monotonic(), time.monotonic() - start))
                if not done:
                    failures.append("no [DONE]")
            except httpx.HTTPError as exc:
                failures.append(repr(exc))
            stop.wait(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--pid", type=int, required=True, help="the server's front-end process")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--top-logprobs", type=int, default=20)
    p.add_argument("--trickle-s", type=float, default=0.5)
    p.add_argument("--echo", type=int, default=0, help="tricklers echo a prompt of this many tokens to 8 choices "
                                                       "(/v1/completions), more than the kernel's buffers take")
    p.add_argument("--seconds", type=float, default=60.0, help="how long to keep the tricklers open")
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}"

    before = rss_mb(args.pid)
    stop = threading.Event()
    latencies: list[tuple[float, float]] = []
    failures: list[str] = []
    socks = [open_trickler(args.port, args.tokens, args.top_logprobs, args.echo) for _ in range(args.streams)]
    threads = [threading.Thread(target=trickle, args=(socks, args.trickle_s, stop)),
               threading.Thread(target=neighbour, args=(url, stop, latencies, failures))]
    for t in threads:
        t.start()
    peak, start, idle_at, busy_seen = before, time.monotonic(), None, False
    while time.monotonic() - start < args.seconds:
        time.sleep(0.5)
        peak = max(peak, rss_mb(args.pid))
        running = httpx.get(f"{url}/metrics", timeout=10).text
        idle_now = "nanoserve:num_requests_running 0.0" in running and "num_requests_waiting 0.0" in running
        busy_seen = busy_seen or not idle_now
        if idle_at is None and busy_seen and idle_now:
            idle_at = time.monotonic()
    end = rss_mb(args.pid)
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    ended = [line.split()[1] for line in metrics.splitlines()
             if line.startswith("nanoserve:undelivered_output_ended_requests_total")]
    stop.set()
    for t in threads:
        t.join()
    for sock in socks:
        sock.close()
    idle = idle_at or float("inf")
    busy = sorted(s for t, s in latencies if t < idle) or [float("nan")]
    after = sorted(s for t, s in latencies if t >= idle) or [float("nan")]
    print(f"front-end RSS MB: before {before:.0f}, peak {peak:.0f} (+{peak - before:.0f}), at {args.seconds:.0f} s "
          f"{end:.0f} (+{end - before:.0f}); engine idle after "
          f"{'never' if idle_at is None else f'{idle_at - start:.0f} s'}; responses ended by the server "
          f"{ended[0] if ended else 'n/a'} of {args.streams}; neighbour (32 tokens) latency while the engine is busy: median "
          f"{statistics.median(busy):.2f} s, max {busy[-1]:.2f} s ({len(busy)}), once idle: median "
          f"{statistics.median(after):.2f} s, max {after[-1]:.2f} s ({len(after)}); failures {len(failures)} "
          f"{failures[:2]}")


if __name__ == "__main__":
    main()
