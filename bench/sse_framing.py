"""The cost of sending one SSE event: sse-starlette's EventSourceResponse against a plain StreamingResponse.

    python bench/sse_framing.py [--events 20000]

Both stream the same pre-framed `data: {...}\\n\\n` events (bytes) through their ASGI call to a
`send` that only counts, so what is timed is the response class's own work per event. CPU only:
this is the work the front end's event loop does per chunk, whatever the device.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
from starlette.responses import StreamingResponse

try:
    from sse_starlette import EventSourceResponse
except ImportError:  # no longer a dependency: `pip install sse-starlette` to compare
    EventSourceResponse = None

CHUNK = orjson.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
                      "choices": [{"index": 0, "text": " word", "logprobs": None, "finish_reason": None}]})


async def events(n: int):
    event = b"data: " + CHUNK + b"\n\n"
    for _ in range(n):
        yield event


async def time_response(make, n: int) -> float:
    sent = 0

    async def receive():
        await asyncio.Event().wait()  # the client never leaves

    async def send(message):
        nonlocal sent
        sent += 1

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "GET", "path": "/", "headers": []}
    start = time.perf_counter()
    await make(events(n))(scope, receive, send)
    seconds = time.perf_counter() - start
    assert sent >= n
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    makers = {"StreamingResponse": lambda it: StreamingResponse(it, media_type="text/event-stream")}
    if EventSourceResponse is not None:
        makers["sse-starlette EventSourceResponse"] = lambda it: EventSourceResponse(it, sep="\n", ping=3600)
    for name, make in makers.items():
        best = min(asyncio.run(time_response(make, args.events)) for _ in range(args.repeats))
        print(f"{name:>34}: {1e6 * best / args.events:6.2f} us per event ({args.events} events, best of "
              f"{args.repeats})")


if __name__ == "__main__":
    main()
