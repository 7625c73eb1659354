"""`serve --root-path /llm` (vLLM's flag): behind a proxy that routes by a path prefix, every route
is served with the prefix or without it (the proxy may strip it or keep it), the API key check and
its exemptions see the route's own path, and the API docs name the prefix."""

from __future__ import annotations

import httpx

from tests.server.conftest import in_process_server, serve_refusal, tiny_engine


def test_routes_answer_with_and_without_the_prefix(server_model):
    from nanoserve.server.app import build_app
    from nanoserve.server.state import ServerSettings

    settings = ServerSettings(served_model_names=["tiny"], root_path="/llm", api_key="sesame")
    key = {"Authorization": "Bearer sesame"}
    with in_process_server(build_app(tiny_engine(server_model), settings)) as (url, _):
        body = {"model": "tiny", "prompt": "The weather", "max_tokens": 4, "temperature": 0}
        plain = httpx.post(f"{url}/v1/completions", json=body, headers=key, timeout=60)
        prefixed = httpx.post(f"{url}/llm/v1/completions", json=body, headers=key, timeout=60)
        assert plain.status_code == prefixed.status_code == 200, prefixed.text
        assert plain.json()["choices"] == prefixed.json()["choices"]
        for path in ("/health", "/llm/health", "/llm/health/", "/llm//ping"):   # probes need no key
            assert httpx.get(f"{url}{path}", timeout=10).status_code == 200, path
        refused = httpx.post(f"{url}/llm/v1/completions", json=body, timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/llm//v1/models/", headers=key, timeout=10).json()["data"][0]["id"] == "tiny"
        assert httpx.get(f"{url}/llmx/v1/models", headers=key, timeout=10).status_code == 404
        spec = httpx.get(f"{url}/llm/openapi.json", headers=key, timeout=10)
        assert spec.status_code == 200 and {"url": "/llm"} in spec.json()["servers"]


def test_a_root_path_that_is_not_a_path_is_refused(monkeypatch, capsys):
    for value in ("llm", "/l m", "/llm?x=1"):
        assert "--root-path must be a URL path" in serve_refusal(monkeypatch, capsys, "--root-path", value)
