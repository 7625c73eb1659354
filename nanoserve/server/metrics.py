"""Prometheus metrics: engine gauges read at scrape time, request latencies measured as tokens stream out.

Names follow vLLM's (`vllm:` becomes `nanoserve:`) so existing dashboards need only the prefix changed.
Each app has its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nanoserve.engine.async_engine import EngineStats

# the `_created` timestamp series double the output and no dashboard reads them (vLLM turns them off too)
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)


class EngineCollector(Collector):
    """Reads the engine's last published stats snapshot whenever /metrics is scraped."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield GaugeMetricFamily("nanoserve:num_requests_running", "Requests in the running batch", s.num_running)
        yield GaugeMetricFamily("nanoserve:num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting)
        yield GaugeMetricFamily("nanoserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)",
                                s.kv_cache_usage)
        yield GaugeMetricFamily("nanoserve:kv_cache_blocks_in_use", "KV-cache blocks held by requests",
                                s.blocks_in_use)
        yield GaugeMetricFamily("nanoserve:kv_cache_blocks_total", "KV-cache blocks in the pool", s.num_blocks)
        rate = s.prefix_hit_tokens / s.prefix_queried_tokens if s.prefix_queried_tokens else 0.0
        yield GaugeMetricFamily("nanoserve:prefix_cache_hit_rate",
                                "Prompt tokens found in the prefix cache / prompt tokens looked up, since start", rate)
        yield CounterMetricFamily("nanoserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  s.prefix_queried_tokens)
        yield CounterMetricFamily("nanoserve:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  s.prefix_hit_tokens)
        yield CounterMetricFamily("nanoserve:num_preemptions", "Sequences preempted for lack of KV blocks",
                                  s.num_preemptions)


class ServerMetrics:
    """The registry of one server and the request-level metrics it records."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats))
        r = self.registry
        self.prompt_tokens = Counter("nanoserve:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("nanoserve:generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter("nanoserve:request_success", "Finished choices by finish reason",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram("nanoserve:time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("nanoserve:inter_token_latency_seconds", "Time between tokens of a choice",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("nanoserve:e2e_request_latency_seconds", "Arrival to last token", registry=r,
                             buckets=_LATENCY_BUCKETS)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Latencies of one request, fed with each update as it reaches the HTTP side."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.last: dict[int, float] = {}  # choice index -> time of its last token

    def tokens(self, index: int, num_tokens: int) -> None:
        if not num_tokens:
            return
        now = time.perf_counter()
        last = self.last.get(index)
        if last is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe((now - last) / num_tokens)
        self.last[index] = now
        self.metrics.generation_tokens.inc(num_tokens)

    def prompt(self, num_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(num_tokens)

    def finished(self, reason: str) -> None:
        self.metrics.request_success.labels(reason).inc()
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
