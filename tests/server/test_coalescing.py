"""A client that reads slower than tokens arrive gets fewer, merged chunks: the same text and logprobs.

A slow reader is hard to make on loopback, where the kernel buffers megabytes before the server's
writes block. So the server here (uvicorn on 127.0.0.1 in this process, its engine core on a
thread) sits behind an ASGI wrapper that makes every body write of a marked request take 30 ms,
as a write to a full socket buffer does; the client reads as fast as it can. The delay is a few
times the fast stream's own time per token, so a loaded machine's slower steps still merge.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from nanoserve import EngineConfig
from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.server.app import build_app
from nanoserve.server.state import ServerSettings
from tests.server.conftest import DEVICE, in_process_server

SLOW_WRITE_S = [0.03]   # set per test from the measured token rate


def slow_writes(app):
    async def wrapped(scope, receive, send):
        slow = scope["type"] == "http" and (b"x-slow-reader", b"1") in scope.get("headers", [])

        async def slow_send(message):
            if slow and message["type"] == "http.response.body":
                await asyncio.sleep(SLOW_WRITE_S[0])
            await send(message)

        await app(scope, receive, slow_send)
    return wrapped


@pytest.fixture(scope="module")
def url(server_model):
    config = EngineConfig(model=server_model, device=DEVICE, num_kvcache_blocks=256, block_size=16)
    engine = AsyncEngine(config, engine=LLMEngine(config))
    with in_process_server(slow_writes(build_app(engine, ServerSettings(served_model_names=["tiny"])))) as (url, _):
        yield url


def events(url: str, slow: bool) -> list[dict]:
    body = {"prompt": "A list of", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 2}
    headers = {"x-slow-reader": "1"} if slow else {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_a_slow_reader_gets_fewer_merged_chunks_with_the_same_text_and_logprobs(url):
    start = time.monotonic()
    fast = events(url, slow=False)
    SLOW_WRITE_S[0] = max(0.03, 4 * (time.monotonic() - start) / len(fast))
    slow = events(url, slow=True)
    assert len(slow) < len(fast) / 2  # what it could not take in time merged into fewer chunks
    for chunks in (fast, slow):
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    def joined(chunks: list[dict], key: str) -> list:
        return [x for c in chunks for x in (c["choices"][0]["logprobs"] or {}).get(key, [])]

    assert "".join(c["choices"][0]["text"] for c in slow) == "".join(c["choices"][0]["text"] for c in fast)
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert joined(slow, key) == joined(fast, key)
    assert len(joined(slow, "tokens")) == 200
