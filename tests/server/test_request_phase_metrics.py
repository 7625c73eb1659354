"""/metrics charts each request's phases as vLLM's dashboards read them: time queued in the engine,
prefill (first run to first token), decode, inference, and prompt and output lengths."""

from __future__ import annotations

import threading
import time

import httpx

from tests.server.conftest import DEVICE, metrics_text, serving


def _samples(url: str, prefix: str) -> dict[str, float]:
    text = metrics_text(url)
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix)}


def test_a_request_that_waits_for_a_seat_shows_its_queue_time(server_model):
    from nanoserve import EngineConfig
    from nanoserve.engine.async_engine import AsyncEngine

    # one seat: the second request waits in the engine until the first is done
    engine = AsyncEngine(EngineConfig(model=server_model, device=DEVICE, num_kvcache_blocks=128, block_size=16,
                                      max_num_seqs=1))
    with serving(engine) as (url, _):
        first_done: list[float] = []
        first = threading.Thread(target=lambda: (httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": "A long list of", "max_tokens": 300, "ignore_eos": True}), first_done.append(time.monotonic())))
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "prompt": "Count:", "max_tokens": 2, "ignore_eos": True, "stream": True}) as warm:
            list(warm.iter_lines())
        first.start()
        while _samples(url, "nanoserve:num_requests_running").get("nanoserve:num_requests_running", 0) < 1:
            time.sleep(0.01)
        sent = time.monotonic()
        second = httpx.post(f"{url}/v1/completions", timeout=120,
                            json={"prompt": "Then", "max_tokens": 5, "ignore_eos": True}).json()
        first.join(120)
        m = _samples(url, "nanoserve:request_")
        waited = first_done[0] - sent   # about how long the second stood behind the first
        assert m["nanoserve:request_queue_time_seconds_count"] == 3
        assert m["nanoserve:request_queue_time_seconds_sum"] >= 0.8 * waited - 0.05, (m, waited)
        for phase in ("prefill", "decode", "inference"):
            assert m[f"nanoserve:request_{phase}_time_seconds_count"] == 3
        assert (m["nanoserve:request_inference_time_seconds_sum"]
                >= m["nanoserve:request_decode_time_seconds_sum"] + m["nanoserve:request_prefill_time_seconds_sum"]
                - 1e-6)
        assert m["nanoserve:request_generation_tokens_sum"] == 2 + 300 + 5
        prompt_sum = m["nanoserve:request_prompt_tokens_sum"]
        assert prompt_sum > second["usage"]["prompt_tokens"] and m["nanoserve:request_prompt_tokens_count"] == 3
        # a request that never waited: the queue's sum is the second's wait plus a few milliseconds
        assert m["nanoserve:request_queue_time_seconds_sum"] < waited + 1.0
        # vLLM's sampling-parameter histograms: each request's n and max_tokens
        assert m["nanoserve:request_params_n_count"] == 3 and m["nanoserve:request_params_n_sum"] == 3
        assert m["nanoserve:request_params_max_tokens_sum"] == 2 + 300 + 5
        assert m['nanoserve:request_params_max_tokens_bucket{le="2.0"}'] == 1
        # and the engine's steps by their tokens: one seat, so the long request's ~300 decode steps
        # ran one token each; every token run through the model is in the sum, each prompt token once
        steps = _samples(url, "nanoserve:iteration_tokens_total")
        assert steps['nanoserve:iteration_tokens_total_bucket{le="+Inf"}'] == steps["nanoserve:iteration_tokens_total_count"]
        assert steps['nanoserve:iteration_tokens_total_bucket{le="1.0"}'] >= 299
        assert 2 + 300 + 5 - 3 <= steps["nanoserve:iteration_tokens_total_sum"] <= prompt_sum + 2 + 300 + 5
        # the cache's settings as labels, as vLLM's cache_config_info gives them to capacity dashboards
        (info,) = [line for line in metrics_text(url).splitlines() if line.startswith("nanoserve:cache_config_info{")]
        for label in ('block_size="16"', 'cache_dtype="auto"', 'enable_prefix_caching="True"', 'num_gpu_blocks="128"'):
            assert label in info, info
        assert info.endswith(" 1.0")


def test_choices_cut_short_count_as_aborted_as_vllm_labels_them(server_model):
    from nanoserve import EngineConfig
    from nanoserve.engine.async_engine import AsyncEngine

    # a client gone mid-stream left its choices in no finish reason: /metrics never showed them
    engine = AsyncEngine(EngineConfig(model=server_model, device=DEVICE, num_kvcache_blocks=128, block_size=16))
    with serving(engine) as (url, _):
        httpx.post(f"{url}/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "prompt": "A long list of", "max_tokens": 1000, "n": 3, "ignore_eos": True, "stream": True}) as cut:
            lines = cut.iter_lines()
            while not next(lines).startswith("data: "):
                pass
        deadline = time.monotonic() + 30
        name = "nanoserve:request_success_total"
        while _samples(url, name).get(f'{name}{{finished_reason="abort"}}') != 3:
            assert time.monotonic() < deadline, _samples(url, name)
            time.sleep(0.05)
        assert _samples(url, name)[f'{name}{{finished_reason="length"}}'] == 1
