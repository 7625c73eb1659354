"""How long one huge request stalls the other streams of a running server.

    nanoserve serve --port 8000 &
    python bench/loop_stall.py --url http://127.0.0.1:8000

One stream of 300 tokens runs while a second request sends a ~1.8 MB text prompt (refused as too
long only once it is tokenized). Prints the stream's median and largest gap between SSE events:
if the server tokenizes on its event loop, the largest gap is the whole tokenization.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx


async def _stream(client: httpx.AsyncClient, url: str, gaps: list[float]) -> None:
    body = {"prompt": "A list is", "max_tokens": 300, "temperature": 0, "stream": True, "ignore_eos": True}
    last = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now


async def _huge(client: httpx.AsyncClient, url: str, repeats: int) -> int:
    await asyncio.sleep(0.3)  # let the stream get going
    text = "The quick brown fox jumps over the lazy dog. " * repeats
    response = await client.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 1})
    return response.status_code


async def run(url: str, repeats: int) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        gaps: list[float] = []
        _, status = await asyncio.gather(_stream(client, url, gaps), _huge(client, url, repeats))
    gaps.sort()
    print(f"loop stall: huge prompt answered {status}; stream gaps median {1e3 * gaps[len(gaps) // 2]:.1f} ms, "
          f"largest {1e3 * gaps[-1]:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--repeats", type=int, default=40000, help="copies of a 45-character sentence")
    args = parser.parse_args()
    asyncio.run(run(args.url, args.repeats))


if __name__ == "__main__":
    main()
