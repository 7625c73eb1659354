"""Serving load on a running server: streamed /v1/completions arriving at a request rate.

    nanoserve serve MODEL --port 8000 &
    nanoserve bench serving --url http://127.0.0.1:8000 --num-requests 256 --request-rate 16 --num-clients 4
    python bench/serving.py ...   (the same)

Prompts are random token ids and outputs have random lengths with `ignore_eos` (nano-vllm's
lengths by default), so each request yields exactly the tokens it asks for. Requests arrive as a
Poisson process (`--request-rate inf`: all at once), spread over `--num-clients` processes so
that the client is not what limits the measurement; each reports its CPU time, and a run whose
client was busy most of the time says so. The default client reads the SSE stream raw (it parses
only the error and usage events); `--client openai` uses the openai package instead. Reports
output tokens per second over the whole run and, per request, time to first token (TTFT), time
per output token after the first (TPOT), the gaps between streamed chunks (ITL) and end-to-end
latency. Exits non-zero if any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import statistics
import sys
import time
from dataclasses import dataclass, field
from random import Random

import httpx

CLIENT_BOUND = 0.8  # a client process busy this fraction of the run may have slowed it down


@dataclass
class RequestResult:
    max_tokens: int = 0     # what it asked for: with ignore_eos, what it must get
    sent: float = 0.0       # wall-clock times (time.time()), comparable across client processes
    ended: float = 0.0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    chunk_gaps: list[float] = field(default_factory=list)
    error: str | None = None
    start: float = field(default_factory=time.perf_counter)  # perf_counter() when the request was sent
    last: float = 0.0                                        # ... and when its latest chunk came

    def chunk(self) -> None:
        """A chunk with choices arrived now: the first sets TTFT, each later one adds a gap."""
        now = time.perf_counter()
        if not self.ttft:
            self.ttft = now - self.start
        else:
            self.chunk_gaps.append(now - self.last)
        self.last = now

    def done(self) -> RequestResult:
        self.latency = time.perf_counter() - self.start
        return self


def build_workload(args: argparse.Namespace) -> list[tuple[float, list[int], int]]:
    """(arrival offset in seconds, prompt token ids, max_tokens) per request."""
    rng, arrivals = Random(args.seed), Random(args.seed + 1)
    workload, at = [], 0.0
    for _ in range(args.num_requests):
        prompt = [rng.randint(0, args.max_token_id) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
        workload.append((at, prompt, rng.randint(args.min_output_len, args.max_output_len)))
        if args.request_rate != float("inf"):
            at += arrivals.expovariate(args.request_rate)
    return workload


def _body(model: str, prompt: list[int], max_tokens: int, temperature: float) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


async def raw_request(client: httpx.AsyncClient, body: dict) -> RequestResult:
    """One streamed request, timed per SSE event; only error and usage events are parsed."""
    result = RequestResult()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if '"usage":{' in line or '"error":' in line:
                        event = json.loads(line[6:])
                        if "error" in event:
                            result.error = f"stream error: {event['error'].get('message')}"
                        if event.get("usage"):
                            result.output_tokens = event["usage"]["completion_tokens"]
                        if not event.get("choices"):
                            continue
                    result.chunk()
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result.done()


async def openai_request(client, body: dict) -> RequestResult:
    import openai

    result = RequestResult()
    try:
        stream = await client.completions.create(
            model=body["model"], prompt=body["prompt"], max_tokens=body["max_tokens"],
            temperature=body["temperature"], stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                result.chunk()
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
    except openai.APIError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result.done()


async def _client_run(args: argparse.Namespace, model: str, share: list[tuple[float, list[int], int]],
                      start_at: float) -> list[RequestResult]:
    """One client's share of the workload, each request sent at its arrival offset from `start_at`."""
    limit = asyncio.Semaphore(args.max_concurrency or len(share) or 1)
    if args.client == "openai":
        import openai

        client = openai.AsyncOpenAI(base_url=f"{args.url}/v1", api_key=args.api_key or "unused", max_retries=0,
                                    timeout=args.timeout)
        send = openai_request
    else:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        client = httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout,
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        send = raw_request

    async def one(at: float, prompt: list[int], max_tokens: int) -> RequestResult:
        await asyncio.sleep(max(0.0, start_at + at - time.time()))
        async with limit:
            sent = time.time()
            result = await send(client, _body(model, prompt, max_tokens, args.temperature))
        result.max_tokens, result.sent, result.ended = max_tokens, sent, time.time()
        return result

    try:
        return await asyncio.gather(*(one(*item) for item in share))
    finally:
        await (client.close() if args.client == "openai" else client.aclose())


def _client_process(args: argparse.Namespace, model: str, share: list, start, ready, queue) -> None:
    ready.wait()  # every client is up (imports done) before the first arrival
    cpu = time.process_time()
    results = asyncio.run(_client_run(args, model, share, start.value))
    queue.put((results, time.process_time() - cpu))


async def first_model(args: argparse.Namespace) -> str:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=30) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace) -> dict:
    """Send the workload from `args.num_clients` processes (this one when 1); return totals and
    per-request latencies (seconds)."""
    workload = build_workload(args)
    model = args.model or await first_model(args)
    shares = [workload[k::args.num_clients] for k in range(args.num_clients)]
    if args.num_clients == 1:
        cpu = time.process_time()
        results = await _client_run(args, model, shares[0], time.time())
        per_client = [(results, time.process_time() - cpu)]
    else:
        context = multiprocessing.get_context("spawn")
        queue, start, ready = context.Queue(), context.Value("d", 0.0), context.Barrier(args.num_clients + 1)
        procs = [context.Process(target=_client_process, args=(args, model, share, start, ready, queue))
                 for share in shares]
        for p in procs:
            p.start()
        start.value = time.time() + 0.1
        await asyncio.to_thread(ready.wait)
        per_client = [await asyncio.to_thread(queue.get) for _ in procs]
        for p in procs:
            p.join()
    results = [r for rs, _ in per_client for r in rs]
    # from the first request sent to the last one done, whichever process sent them
    seconds = max(r.ended for r in results) - min(r.sent for r in results)
    done = [r for r in results if r.error is None]
    cpu = [c for _, c in per_client]
    return {"seconds": seconds, "requests": len(results), "failed": len(results) - len(done),
            "errors": [r.error for r in results if r.error][:5],
            "expected_tokens": sum(r.max_tokens for r in done),
            "output_tokens": sum(r.output_tokens for r in done),
            "ttft": [r.ttft for r in done], "latency": [r.latency for r in done],
            "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
            "itl": [gap for r in done for gap in r.chunk_gaps],
            "client_cpu": cpu, "num_clients": args.num_clients}


def report(stats: dict, request_rate: float) -> str:
    lines = [f"serving: {stats['requests']} requests ({stats['failed']} failed), {stats['output_tokens']} output "
             f"tokens in {stats['seconds']:.2f} s = {stats['output_tokens'] / stats['seconds']:.0f} tok/s, "
             f"{(stats['requests'] - stats['failed']) / stats['seconds']:.2f} req/s (request rate {request_rate})",
             f"{'ms':>8} {'mean':>9} {'min':>9} {'median':>9} {'p99':>9}"]
    for name in ("ttft", "tpot", "itl", "latency"):
        values = sorted(stats[name])
        if values:
            p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
            lines.append(f"{name:>8} {1e3 * statistics.fmean(values):9.2f} {1e3 * values[0]:9.2f} "
                         f"{1e3 * statistics.median(values):9.2f} {1e3 * p99:9.2f}")
    busiest = max(stats["client_cpu"]) / stats["seconds"]
    lines.append(f"client: {stats['num_clients']} process(es), CPU {sum(stats['client_cpu']):.1f} s in all, the "
                 f"busiest {100 * busiest:.0f}% of the run" +
                 (" -- CLIENT-BOUND: add --num-clients" if busiest > CLIENT_BOUND else ""))
    lines += [f"error: {e}" for e in stats["errors"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nanoserve bench serving", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second")
    parser.add_argument("--max-concurrency", type=int, default=None, help="per client process")
    parser.add_argument("--num-clients", type=int, default=1, help="client processes sharing the workload")
    parser.add_argument("--client", choices=["raw", "openai"], default="raw",
                        help="raw: httpx, parsing only error and usage events; openai: the openai package")
    parser.add_argument("--min-input-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--min-output-len", type=int, default=100)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-token-id", type=int, default=4000,
                        help="prompt ids are drawn from 0..this (within the bundled model's 4096 ids)")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    args = parser.parse_args(argv)
    if args.num_clients < 1:
        parser.error("--num-clients must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    stats = asyncio.run(run_benchmark(args))
    print(report(stats, args.request_rate))
    if stats["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
