"""What goes over the wire: JSON bodies in, JSON and SSE out, and cancellation when the client leaves."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from nanoserve.server.errors import APIError, from_validation_error

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


def json_response(content: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content), status, headers, media_type="application/json")


# a whole response whose choices pass this many bytes is sent as its choices are written
STREAMED_BODY_BYTES = 1 << 20


async def whole_json_response(head: dict, choices: AsyncIterator[bytes], tail: dict) -> Response:
    """The JSON object of `head`'s fields, "choices" (each one JSON already), then `tail`'s fields.

    A small body goes out whole, with its Content-Length. Past STREAMED_BODY_BYTES of choices the
    rest is sent as it is written, a choice at a time: 256 choices that echo a 2k-token prompt's
    logprobs make 1 GB, which held whole took 2.4 GB of memory, and orjson joined it in one 3 s
    call during which every other stream and /health waited."""
    parts = [orjson.dumps(head)[:-1] + b',"choices":[']
    size = 0
    async for choice in choices:
        parts.append(choice if len(parts) == 1 else b"," + choice)
        size += len(choice)
        if size > STREAMED_BODY_BYTES:
            return StreamingResponse(_written(parts, choices, tail), media_type="application/json")
    parts.append(_closing(tail))
    return Response(b"".join(parts), media_type="application/json")


async def _written(parts: list[bytes], rest: AsyncIterator[bytes], tail: dict) -> AsyncIterator[bytes]:
    yield b"".join(parts)
    parts.clear()
    async for choice in rest:
        yield b"," + choice
    yield _closing(tail)


def _closing(tail: dict) -> bytes:
    return b"]," + orjson.dumps(tail)[1:] if tail else b"]}"


def sse_event(payload: object) -> bytes:
    """One SSE event: `data: <json>` and a blank line (orjson never writes a raw newline)."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer a stream


def sse_response(events: AsyncIterator[bytes], on_close: Callable[[], None]) -> StreamingResponse:
    """Stream pre-framed SSE events; `on_close` runs however the stream ends, even if it never started.

    A plain StreamingResponse: the events are bytes already, and sse-starlette's task and cancel
    scope per event cost more than the rest of a chunk's path (see BENCHMARKS.md). On a disconnect
    Starlette cancels `events`, whose cleanup aborts the request; the background task covers a
    stream that ends before `events` ever ran."""
    return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS,
                             background=BackgroundTask(on_close))


INLINE_BODY_BYTES = 256 * 1024   # larger bodies are validated on a worker thread, off the event loop


# every byte but the three the count reads: quotes, commas and colons
_NOT_MARKS = bytes(b for b in range(256) if b not in b'",:')
_QUOTED = re.compile(rb'"[^"]*"')
# of those marks, read at once between two turns of the event loop (~30 ms at worst, all quotes)
_MARKS_PER_TURN = 256 * 1024


async def check_json_values(body: bytes, limit: int) -> None:
    """413 for a body of more JSON values than `limit`, counted from its bytes without parsing it.

    Validation holds the interpreter lock from start to end, even on a worker thread, so its time
    is everyone's: a body of millions of tiny values stalled every other stream for seconds. Every
    value but the first of an array or object follows a comma, every member's value a colon. The
    quick count includes those inside strings; only a body over the limit by it is counted again
    without its strings, so that comma-rich prompt text is not refused."""
    if len(body) <= limit:
        return   # fewer bytes than the limit: fewer values
    values = body.count(b",") + body.count(b":")
    if values > limit:
        values = await _values_outside_strings(body)
    if values > limit:
        raise APIError(f"The request body holds about {values} JSON values; this server parses at most {limit} "
                       "(--max-request-json-values): split it into smaller requests", param=None,
                       code="request_too_complex", status=413)


async def _values_outside_strings(body: bytes) -> int:
    """The commas and colons of `body` outside its strings, read a piece at a time: one regex over
    the whole of a 30 MB body of ten million empty strings (or of escaped quotes) held the event
    loop, and every stream, for 2.5 s."""
    # escapes pair from the left, so once escaped backslashes and then escaped quotes are gone,
    # every quote left opens or closes a string; then only quotes, commas and colons are kept
    marks = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_MARKS)
    values, inside = 0, False
    for start in range(0, len(marks), _MARKS_PER_TURN):
        piece = marks[start:start + _MARKS_PER_TURN]
        quotes = piece.count(b'"') + inside
        # a string open at either end of the piece is closed there, so that it is removed whole
        framed = (b'"' if inside else b"") + piece + (b'"' if quotes % 2 else b"")
        values += len(_QUOTED.sub(b"", framed))   # the commas and colons left are outside strings
        inside = quotes % 2 == 1
        await asyncio.sleep(0)
    return values


async def read_body(request: Request) -> bytes:
    """The whole body; Starlette keeps it, so that a later read gets it again."""
    try:
        return await request.body()
    except ClientDisconnect:   # gone, or cut off by --timeout-body: nobody reads the answer
        raise APIError("The connection closed before the request body was complete", param=None,
                       code="incomplete_body") from None


async def parse_body(request: Request, model: type[M]) -> M:
    """The request's JSON body validated against `model`; any problem is a 400 naming the field."""
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise APIError(f"Content-Type must be application/json, got {content_type!r}; send a JSON body "
                       "with the header 'Content-Type: application/json'", param=None, code="invalid_content_type")
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):   # an empty header names no coding: the body is as sent
        raise APIError(f"Content-Encoding {encoding!r} is not supported: send the JSON body uncompressed",
                       param=None, code="unsupported_content_encoding")
    body = await read_body(request)
    await check_json_values(body, request.app.state.server.settings.limits.max_request_json_values)
    try:
        if len(body) <= INLINE_BODY_BYTES:
            return model.model_validate_json(body)
        # a body of many small objects (500,000 messages in 9 MB) takes seconds to validate
        return await run_in_threadpool(model.model_validate_json, body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`, cancelling it if the client disconnects first (then return None).

    Without this a non-streaming request whose client gave up would keep its KV blocks and its
    place in the batch until it finished on its own.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled and a 499 raised.

    For what a request waits on before it starts (a compile worker: specs queue behind each other,
    each up to the deadline): an abandoned request must not keep its place in that queue, nor a
    worker, while requests whose clients are still there wait behind it."""
    task = asyncio.ensure_future(work)   # its state tells a result of None from a disconnect
    await cancel_on_disconnect(request, task)
    if task.cancelled():
        raise APIError("The client closed the connection before the request started", 499,
                       code="client_closed_request")
    return task.result()


async def _disconnected(request: Request) -> None:
    # the body was read already: the next message is the disconnect (or never comes)
    while (await request.receive())["type"] != "http.disconnect":
        pass
