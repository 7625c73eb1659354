"""A crash in the engine loop fails the requests in flight with 503s and turns /health to 503.

The server runs in this process (uvicorn on 127.0.0.1, in a thread, its engine core on another
thread) so that the test can make the engine's step raise at a moment of its choosing. The
engine process's death is tested on a real `nanoserve serve` in test_engine_process.py.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn

from nanoserve import EngineConfig
from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.server.app import build_app
from nanoserve.server.state import ServerSettings
from tests.server.conftest import DEVICE, free_port, interrupt_a_stream


@pytest.fixture(scope="module")
def failing_server(server_model):
    config = EngineConfig(model=server_model, device=DEVICE, num_kvcache_blocks=128, block_size=16)
    core = LLMEngine(config)
    engine = AsyncEngine(config, engine=core)
    fail = threading.Event()
    real_step = core.step

    def step():
        if fail.is_set():
            raise RuntimeError("simulated CUDA error: an illegal memory access was encountered")
        return real_step()

    core.step = step
    app = build_app(engine, ServerSettings(served_model_names=["tiny"]))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.config.port}", fail
    server.should_exit = True
    thread.join(30)


def test_requests_in_flight_fail_with_503_and_health_turns_503(failing_server):
    url, fail = failing_server
    assert httpx.get(f"{url}/health").status_code == 200
    body = {"prompt": "A list", "max_tokens": 1000, "ignore_eos": True}
    first, rest, r = interrupt_a_stream(url, body, fail.set)
    assert "choices" in first  # it was streaming when the engine died
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    # the cause is for the log, not for clients: they hear that the engine is gone
    assert error["type"] == "server_error" and error["code"] == "engine_dead"
    assert "illegal memory access" not in error["message"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"

    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    # 503, which a client may retry once the server is restarted, never a 500
    late = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
    assert set(late.json()["error"]) == {"message", "type", "param", "code"}


def test_the_periodic_engine_line_stops_once_the_engine_is_dead(monkeypatch, caplog):
    # the line read the dead core's last stats ("6 running, KV cache 14% used") every interval
    # through the grace period, as if the requests it had failed still ran
    import asyncio
    import logging
    from types import SimpleNamespace

    import nanoserve.server.app as app_module
    from nanoserve.engine.messages import EngineStats

    monkeypatch.setattr(app_module, "STATS_INTERVAL_S", 0.01)

    async def log_for_a_while(engine) -> None:
        task = asyncio.create_task(app_module._log_stats(engine))
        await asyncio.sleep(0.2)
        task.cancel()

    async def lines(dead: bool) -> list[str]:
        engine = SimpleNamespace(stats=EngineStats(num_running=6, num_blocks=8, num_free_blocks=2),
                                 dead=asyncio.Event())
        if dead:
            engine.dead.set()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="nanoserve.server.app"):
            await log_for_a_while(engine)
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Engine: ")]

    assert asyncio.run(lines(dead=False))   # the line is there while the engine lives
    assert asyncio.run(lines(dead=True)) == []
