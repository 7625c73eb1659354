"""Inter-token latency as vLLM charts it: each interval between a choice's tokens, under
`inter_token_latency_seconds` and its older name `time_per_output_token_seconds`; each request's mean
under `request_time_per_output_token_seconds`."""

from __future__ import annotations

import re

import httpx
from prometheus_client import generate_latest

from nanoserve.engine.messages import EngineStats
from nanoserve.server import metrics as module
from nanoserve.server.metrics import ServerMetrics
from tests.server.conftest import metrics_text


def histogram(text: str, name: str) -> dict[str, float]:
    """A histogram's buckets by bound, with its count and sum."""
    out = {}
    for bound, value in re.findall(rf'^{re.escape(name)}_bucket{{le="([^"]+)"}} (\S+)$', text, re.MULTILINE):
        out[bound] = float(value)
    for part in ("count", "sum"):
        out[part] = float(re.search(rf"^{re.escape(name)}_{part} (\S+)$", text, re.MULTILINE).group(1))
    return out


def test_each_interval_between_a_choices_tokens_is_counted(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(module.time, "perf_counter", lambda: now[0])
    metrics = ServerMetrics(lambda: EngineStats(), log_requests=False)
    timer = metrics.timer()
    for at, tokens, choice in ((100.5, 1, 0), (100.503, 1, 1), (100.509, 1, 0), (100.511, 2, 1), (100.8, 3, 0)):
        now[0] = at
        timer.tokens(tokens, choice)
    timer.done()
    text = generate_latest(metrics.registry).decode()
    for name in ("nanoserve:inter_token_latency_seconds", "nanoserve:time_per_output_token_seconds"):
        h = histogram(text, name)
        # choice 0: 9 ms, then 291 ms over 3 tokens (97 ms each); choice 1: 8 ms over 2 tokens (4 ms each)
        assert h["count"] == 1 + 3 + 2
        assert abs(h["sum"] - (0.009 + 0.291 + 0.008)) < 1e-9
        assert (h["0.005"], h["0.01"], h["0.08"], h["0.1"], h["+Inf"]) == (2, 3, 3, 6, 6)
    mean = histogram(text, "nanoserve:request_time_per_output_token_seconds")
    assert mean["count"] == 1 and abs(mean["sum"] - 0.3 / 7) < 1e-9   # first to last token over 8 tokens


def test_a_served_stream_counts_its_intervals(server):
    def count() -> float:
        text = metrics_text(server.url)
        return histogram(text, "nanoserve:inter_token_latency_seconds")["count"]

    before = count()
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "Count:", "max_tokens": 12, "ignore_eos": True, "stream": True}) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 2
    # every token but those of the first update has an interval (an update may carry several)
    assert 1 <= count() - before <= 11
