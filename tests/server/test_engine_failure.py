"""A crash in the engine loop fails the requests in flight with 500s and turns /health to 503.

The server runs in this process (uvicorn on 127.0.0.1, in a thread) so that the test can make
the engine's step raise at a moment of its choosing.
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
from nanoserve.server.app import build_app
from nanoserve.server.state import ServerSettings
from tests.server.conftest import DEVICE, free_port


@pytest.fixture(scope="module")
def failing_server(server_model):
    engine = AsyncEngine(EngineConfig(model=server_model, device=DEVICE, num_kvcache_blocks=128, block_size=16))
    fail = threading.Event()
    real_step = engine.engine.step

    def step():
        if fail.is_set():
            raise RuntimeError("simulated CUDA error: an illegal memory access was encountered")
        return real_step()

    engine.engine.step = step
    app = build_app(engine, ServerSettings(served_model_names=["tiny"]))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.config.port}", fail
    server.should_exit = True
    thread.join(30)


def test_requests_in_flight_fail_with_500_and_health_turns_503(failing_server):
    url, fail = failing_server
    assert httpx.get(f"{url}/health").status_code == 200
    body = {"prompt": "A list", "max_tokens": 1000, "ignore_eos": True}
    whole: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: whole.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                     timeout=60)))
    waiter.start()
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        data = (line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))
        assert "choices" in json.loads(next(data))  # it is streaming when the engine dies
        fail.set()
        rest = list(data)
    waiter.join(60)

    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["type"] == "server_error" and "illegal memory access" in error["message"]
    (r,) = whole
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"

    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and "illegal memory access" in health.json()["error"]["message"]
    late = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert late.status_code == 500 and set(late.json()["error"]) == {"message", "type", "param", "code"}
