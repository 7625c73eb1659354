"""Serving load on a running server: streamed /v1/completions arriving at a request rate.

    nanoserve serve MODEL --port 8000 &
    nanoserve bench serving --url http://127.0.0.1:8000 --num-requests 256 --request-rate 16
    python bench/serving.py ...   (the same)

Prompts are random token ids and outputs have random lengths with `ignore_eos` (nano-vllm's
lengths by default), so each request yields exactly the tokens it asks for. Requests arrive as a
Poisson process (`--request-rate inf`: all at once). Reports output tokens per second over the
whole run and, per request, time to first token (TTFT), time per output token after the first
(TPOT), the gaps between streamed chunks (ITL) and end-to-end latency.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field
from random import Random

try:
    import openai
except ImportError:  # a test extra, not a server dependency
    raise SystemExit("nanoserve bench serving needs the openai client: pip install openai") from None


@dataclass
class RequestResult:
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    chunk_gaps: list[float] = field(default_factory=list)
    error: str | None = None


def build_workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request."""
    rng = Random(args.seed)
    return [([rng.randint(0, args.max_token_id) for _ in range(rng.randint(args.min_input_len, args.max_input_len))],
             rng.randint(args.min_output_len, args.max_output_len)) for _ in range(args.num_requests)]


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int,
                      temperature: float) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                if not result.ttft:
                    result.ttft = now - start
                else:
                    result.chunk_gaps.append(now - last)
                last = now
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
    except openai.APIError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - start
    return result


async def run_benchmark(args: argparse.Namespace) -> dict:
    """Send the workload; return totals and per-request latencies (seconds)."""
    workload = build_workload(args)
    client = openai.AsyncOpenAI(base_url=f"{args.url}/v1", api_key=args.api_key or "unused",
                                max_retries=0, timeout=args.timeout)
    model = args.model or (await client.models.list()).data[0].id
    limit = asyncio.Semaphore(args.max_concurrency or len(workload))
    arrivals = Random(args.seed + 1)

    async def limited(prompt: list[int], max_tokens: int) -> RequestResult:
        async with limit:
            return await one_request(client, model, prompt, max_tokens, args.temperature)

    start = time.perf_counter()
    tasks = []
    for prompt, max_tokens in workload:
        tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(arrivals.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    seconds = time.perf_counter() - start
    await client.close()
    done = [r for r in results if r.error is None]
    return {"seconds": seconds, "requests": len(results), "failed": len(results) - len(done),
            "errors": [r.error for r in results if r.error][:5],
            "expected_tokens": sum(m for (_, m), r in zip(workload, results) if r.error is None),
            "output_tokens": sum(r.output_tokens for r in done),
            "ttft": [r.ttft for r in done], "latency": [r.latency for r in done],
            "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
            "itl": [gap for r in done for gap in r.chunk_gaps]}


def report(stats: dict, request_rate: float) -> str:
    lines = [f"serving: {stats['requests']} requests ({stats['failed']} failed), {stats['output_tokens']} output "
             f"tokens in {stats['seconds']:.2f} s = {stats['output_tokens'] / stats['seconds']:.0f} tok/s, "
             f"{(stats['requests'] - stats['failed']) / stats['seconds']:.2f} req/s (request rate {request_rate})",
             f"{'ms':>8} {'mean':>9} {'median':>9} {'p99':>9}"]
    for name in ("ttft", "tpot", "itl", "latency"):
        values = sorted(stats[name])
        if values:
            p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
            lines.append(f"{name:>8} {1e3 * statistics.fmean(values):9.2f} {1e3 * statistics.median(values):9.2f} "
                         f"{1e3 * p99:9.2f}")
    lines += [f"error: {e}" for e in stats["errors"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nanoserve bench serving", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--min-input-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--min-output-len", type=int, default=100)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-token-id", type=int, default=10000, help="prompt ids are drawn from 0..this")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(report(asyncio.run(run_benchmark(args)), args.request_rate))


if __name__ == "__main__":
    main()
