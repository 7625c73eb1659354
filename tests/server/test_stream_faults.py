"""A stream whose server side fails after its status line went out: the client still gets an
OpenAI error event and [DONE], and the request is closed (its sequences aborted in the engine).

Driven on the SSE generator itself: no request of the API is known to make the server fail there,
which is what the catch-all is for."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson

from nanoserve.engine.request_stream import RequestUpdate
from nanoserve.server.response import OpenAIResponse
from nanoserve.server.wire import DONE


class OneUpdateStream:
    def __init__(self) -> None:
        self.outputs, self.closed = [], False

    async def __aiter__(self):
        yield RequestUpdate(index=0, text="Hello", token_ids=[1], logprobs=None, finish_reason=None,
                            num_prompt_tokens=3, num_cached_tokens=0)

    def close(self) -> None:
        self.closed = True


class Timer:
    def tokens(self, n: int) -> None: ...
    def finished(self, reason: str) -> None: ...
    def done(self) -> None: ...


def test_a_fault_while_streaming_ends_with_an_error_event_and_done() -> None:
    response = OpenAIResponse(None, SimpleNamespace(include_usage=False, continuous_usage=False, n=1), "m")
    stream = OneUpdateStream()

    def render(update, ids, lps):
        raise KeyError("a bug in rendering")

    async def events() -> list[bytes]:
        return [event async for event in response.sse(stream, Timer(), [{"index": 0}], render)]

    out = asyncio.run(events())
    assert out[-1] == DONE
    assert out[-2].startswith(b"data: ")
    error = orjson.loads(out[-2][len(b"data: "):])["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error" and error["message"]
    assert stream.closed
