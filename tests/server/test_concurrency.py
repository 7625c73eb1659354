"""Many clients at once: all correct, and the ones that leave free their KV blocks at once."""

from __future__ import annotations

import asyncio
import json

import httpx

from nanoserve import SamplingParams

WORDS = "list dict class function value key method object order items".split()


def prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(2 + i % 9))


async def stream_text(client: httpx.AsyncClient, body: dict) -> tuple[str, str | None]:
    text, finish = "", None
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish


def test_64_concurrent_streams_each_equal_offline_greedy(server, offline):
    lengths = [3 + (i * 5) % 28 for i in range(64)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    expected = [o.text for o in offline.generate([prompt(i) for i in range(64)], params, use_tqdm=False)]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(stream_text(client, {"prompt": prompt(i), "max_tokens": lengths[i],
                                                               "temperature": 0, "ignore_eos": True})
                                          for i in range(64)))

    results = asyncio.run(main())
    assert [finish for _, finish in results] == ["length"] * 64
    mismatched = [i for i, ((text, _), ref) in enumerate(zip(results, expected)) if text != ref]
    assert not mismatched, f"streams {mismatched} differ from offline greedy"
    server.wait_idle()


def test_200_clients_leaving_mid_stream_free_every_block(server, offline):
    async def leave_early(client: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": prompt(i), "max_tokens": 1900, "ignore_eos": True, "stream": True, "n": 1 + i % 2}
        events = 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    break  # leaving the block closes the connection mid-stream
        return events

    async def main():
        # one connection per client, so that closing a stream really drops its connection
        clients = [httpx.AsyncClient(base_url=server.url, timeout=120) for _ in range(200)]
        try:
            return await asyncio.gather(*(leave_early(c, i) for i, c in enumerate(clients)))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    assert asyncio.run(main()) == [2] * 200
    # 300 sequences of 1900 tokens would keep the engine busy for minutes: idle soon means aborted
    metrics = server.wait_idle(timeout=10)
    assert metrics["nanoserve:kv_cache_usage_perc"] == 0.0
    # and the server still serves, correctly
    ref = offline.generate(prompt(3), SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].text
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt(3), "max_tokens": 8, "temperature": 0},
                   timeout=60)
    assert r.json()["choices"][0]["text"] == ref


def test_a_non_streaming_client_that_gives_up_aborts_its_request(server):
    body = {"prompt": prompt(1), "ignore_eos": True, "n": 2, "max_tokens": 2000}
    try:
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
        raise AssertionError("2000 tokens on the CPU should take longer than a second")
    except httpx.ReadTimeout:
        pass
    server.wait_idle(timeout=2)  # it would run for many seconds more had it not been aborted

