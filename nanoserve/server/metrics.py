"""Prometheus metrics: engine gauges read at scrape time, request latencies measured as tokens stream out.

Names follow vLLM's (`vllm:` becomes `nanoserve:`) so existing dashboards need only the prefix changed,
or none: with `--metrics-prefix vllm` the server names them `vllm:` itself, for autoscalers and routers
that read vLLM's gauges by name (num_requests_waiting, kv_cache_usage_perc).
Each app has its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import re
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from nanoserve.engine.messages import STEP_TOKEN_BUCKETS, EngineStats
from nanoserve.sampling_params import max_tokens_in_context

logger = logging.getLogger("nanoserve.requests")

# the `_created` timestamp series double the output and no dashboard reads them (vLLM turns them off too)
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_NAME = re.compile(rb"^((?:# (?:HELP|TYPE) )?)nanoserve:", re.MULTILINE)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)


class EngineCollector(Collector):
    """Reads the engine's last published stats snapshot whenever /metrics is scraped.

    Once the engine is dead nothing runs, waits or holds a block: those gauges read 0 rather than
    the last snapshot, and `engine_alive` says why; the counters keep their totals."""

    def __init__(self, stats: Callable[[], EngineStats], alive: Callable[[], bool] = lambda: True,
                 cache_info: dict[str, str] | None = None) -> None:
        """`cache_info`: the KV cache's settings, which cache_config_info labels (the block count aside)."""
        self.stats = stats
        self.alive = alive
        self.cache_info = cache_info or {}

    def collect(self) -> Iterator[Metric]:
        alive, s = self.alive(), self.stats()
        now = s if alive else EngineStats(num_blocks=s.num_blocks, num_free_blocks=s.num_blocks)
        yield GaugeMetricFamily("nanoserve:engine_alive", "1 while the engine core serves, 0 once it died",
                                int(alive))
        yield GaugeMetricFamily("nanoserve:num_requests_running", "Requests in the running batch", now.num_running)
        yield GaugeMetricFamily("nanoserve:num_requests_waiting", "Requests waiting to be scheduled", now.num_waiting)
        yield GaugeMetricFamily("nanoserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)",
                                now.kv_cache_usage)
        yield GaugeMetricFamily("nanoserve:kv_cache_blocks_in_use", "KV-cache blocks held by requests",
                                now.blocks_in_use)
        yield GaugeMetricFamily("nanoserve:kv_cache_blocks_total", "KV-cache blocks in the pool", now.num_blocks)
        rate = s.prefix_hit_tokens / s.prefix_queried_tokens if s.prefix_queried_tokens else 0.0
        yield GaugeMetricFamily("nanoserve:prefix_cache_hit_rate",
                                "Prompt tokens found in the prefix cache / prompt tokens looked up, since start", rate)
        yield CounterMetricFamily("nanoserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  s.prefix_queried_tokens)
        yield CounterMetricFamily("nanoserve:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  s.prefix_hit_tokens)
        yield CounterMetricFamily("nanoserve:num_preemptions", "Sequences preempted: for lack of KV blocks, or by a higher priority",
                                  s.num_preemptions)
        if s.step_token_counts:
            yield _step_tokens(s)
        # vLLM's: the cache's settings as labels of a constant 1, which capacity dashboards read
        info = GaugeMetricFamily("nanoserve:cache_config_info", "The KV cache's settings, as labels",
                                 labels=[*self.cache_info, "num_gpu_blocks"])
        info.add_metric([*self.cache_info.values(), str(s.num_blocks)], 1)
        yield info


def _step_tokens(s: EngineStats) -> HistogramMetricFamily:
    """vLLM's iteration_tokens_total: engine steps by the tokens they ran through the model."""
    cumulative = list(itertools.accumulate(s.step_token_counts))
    buckets = [(str(float(b)), count) for b, count in zip(STEP_TOKEN_BUCKETS, cumulative)]
    return HistogramMetricFamily("nanoserve:iteration_tokens_total", "Tokens run through the model in one engine step",
                                 buckets=buckets + [("+Inf", cumulative[-1])], sum_value=s.computed_tokens)


class ModelLabel(Collector):
    """The samples of a registry's collectors with a `model_name` label added (at scrape time only)."""

    def __init__(self, inner: CollectorRegistry, model_name: str) -> None:
        self.inner, self.model_name = inner, model_name

    def collect(self) -> Iterator[Metric]:
        for metric in self.inner.collect():
            metric.samples = [sample._replace(labels={**sample.labels, "model_name": self.model_name})
                              for sample in metric.samples]
            yield metric


def add_observations(histogram: Histogram, counts: list[int], total: float) -> None:
    """Observations already counted by the histogram's buckets (+Inf last), and their sum, added at
    once: prometheus_client observes one value a call (~2 us), and a stream has an interval a token."""
    histogram._sum.inc(total)
    for bucket, count in zip(histogram._buckets, counts, strict=True):
        if count:
            bucket.inc(count)


def _one_two_five(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`, as vLLM buckets token counts."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return buckets
            buckets.append(float(step * scale))
        scale *= 10


class ServerMetrics:
    """The registry of one server and the request-level metrics it records, once per request.

    With `multiprocess_dir` (front ends sharing one port, server/api_servers.py) the request-level
    counters and histograms are those of every front end, summed from the files prometheus_client
    keeps there (its multiprocess mode, which PROMETHEUS_MULTIPROC_DIR turned on before it was
    imported): a scrape answered by any one process shows the whole server. The engine's gauges come
    from the core's stats, which every front end receives alike."""

    def __init__(self, stats: Callable[[], EngineStats], log_requests: bool = True,
                 alive: Callable[[], bool] = lambda: True, prefix: str = "nanoserve",
                 multiprocess_dir: str | None = None, max_model_len: int = 1 << 17,
                 model_name: str = "model", cache_info: dict[str, str] | None = None) -> None:
        self.log_requests = log_requests  # one log line per finished request
        self.prefix = prefix
        self.registry = CollectorRegistry()
        # what a scrape reads: every series labelled with the served model's name, as vLLM labels
        # them (its dashboards select `{model_name="$model_name"}`)
        self.exposed = CollectorRegistry()
        self.exposed.register(ModelLabel(self.registry, model_name))
        self.registry.register(EngineCollector(stats, alive, cache_info))
        r = self.registry
        if multiprocess_dir is not None:
            MultiProcessCollector(self.registry, path=multiprocess_dir)
            r = CollectorRegistry()   # never scraped: the values go to this process's files
        self.prompt_tokens = Counter("nanoserve:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("nanoserve:generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter("nanoserve:request_success",
                                       "Finished choices by finish reason (abort: ended unfinished)",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram("nanoserve:time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        # as vLLM's: each interval between a stream's tokens (time_per_output_token_seconds is its older
        # name for the same), and each request's mean of them
        self.itl = Histogram("nanoserve:inter_token_latency_seconds", "Time between two tokens of a choice",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("nanoserve:time_per_output_token_seconds",
                              "Time between two tokens of a choice (inter_token_latency_seconds' older name)",
                              registry=r, buckets=_LATENCY_BUCKETS)
        self.request_tpot = Histogram("nanoserve:request_time_per_output_token_seconds",
                                      "Mean time between the tokens of a request after its first", registry=r,
                                      buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("nanoserve:e2e_request_latency_seconds", "Arrival to last token", registry=r,
                             buckets=_LATENCY_BUCKETS)
        # vLLM's names for the phases of a request, which its dashboards chart
        self.queue = Histogram("nanoserve:request_queue_time_seconds", "Time waiting in the engine before first run",
                               registry=r, buckets=_LATENCY_BUCKETS)
        self.prefill = Histogram("nanoserve:request_prefill_time_seconds", "First run to first token", registry=r,
                                 buckets=_LATENCY_BUCKETS)
        self.decode = Histogram("nanoserve:request_decode_time_seconds", "First token to last token", registry=r,
                                buckets=_LATENCY_BUCKETS)
        self.inference = Histogram("nanoserve:request_inference_time_seconds", "First run to last token",
                                   registry=r, buckets=_LATENCY_BUCKETS)
        sizes = _one_two_five(max_model_len)
        self.prompt_sizes = Histogram("nanoserve:request_prompt_tokens", "Prompt tokens of a request", registry=r,
                                      buckets=sizes)
        self.generation_sizes = Histogram("nanoserve:request_generation_tokens", "Tokens generated for a request",
                                          registry=r, buckets=sizes)
        # the sampling parameters a dashboard charts, as vLLM names them
        self.params_n = Histogram("nanoserve:request_params_n", "The n of a request: choices per prompt", registry=r,
                                  buckets=(1, 2, 5, 10, 20))
        self.params_max_tokens = Histogram("nanoserve:request_params_max_tokens",
                                           "The max_tokens of a request (the room left in the context where unset)",
                                           registry=r, buckets=sizes)

    def render(self) -> bytes:
        text = generate_latest(self.exposed)
        if self.prefix == "nanoserve":
            return text
        # names only: a sample line starts with its name, HELP and TYPE lines name it second
        return _NAME.sub(rb"\1" + self.prefix.encode() + b":", text)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Latencies and token counts of one request, from its arrival (before tokenizing) to its end.

    Streaming pays a few attribute writes per update; the histograms are observed once, in `done`."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.request_id = ""   # set by the route once the response has its id
        self.arrival = time.perf_counter()
        self.first: float | None = None     # time of the request's first token
        self.last = 0.0                     # time of its latest token
        self.choice_last: dict[int, float] = {}   # time of each choice's latest token
        # the intervals between a choice's tokens, counted by inter_token_latency_seconds' buckets
        # (+Inf last) and summed: observed once the request ends, not one histogram call a token
        self.intervals = [0] * (len(_LATENCY_BUCKETS) + 1)
        self.interval_sum = 0.0
        self.num_prompt_tokens = 0
        self.n, self.max_tokens = 1, 0   # the request's sampling parameters (max_tokens as resolved)
        self.num_delivered = 0   # tokens the response took in
        self.num_produced = 0    # the engine's count, once the request has ended: more if its client went away
        self.finish_reasons: list[str] = []
        self.num_choices = 0     # the engine's, once the request has ended: those without a finish reason aborted
        self.timing: tuple[float, float] | None = None   # (queued, first run to first token), from the engine
        self.logged = False

    def prompt(self, prompt_lens: list[int], n: int, max_tokens: int | None, max_model_len: int) -> None:
        """The request's prompts' lengths, its n, and its max_tokens as the engine resolves it (within
        the longest prompt's room in the context)."""
        self.num_prompt_tokens, self.n = sum(prompt_lens), n
        self.max_tokens = max_tokens_in_context(max_tokens, max(prompt_lens), max_model_len)

    def tokens(self, num_tokens: int, choice: int = 0) -> None:
        """A choice's update of `num_tokens` tokens has come. Its tokens since the choice's last update
        share the interval evenly (several tokens come at once when the client reads slower than the
        engine writes); a first update's further tokens have no interval of their own."""
        if not num_tokens:
            return
        now = self.last = time.perf_counter()
        if self.first is None:
            self.first = now
        before = self.choice_last.get(choice)
        self.choice_last[choice] = now
        if before is not None:
            self.interval_sum += now - before
            self.intervals[bisect.bisect_left(_LATENCY_BUCKETS, (now - before) / num_tokens)] += num_tokens
        self.num_delivered += num_tokens

    def finished(self, reason: str) -> None:
        self.finish_reasons.append(reason)

    def produced(self, num_tokens: int, finish_reasons: list[str], num_choices: int = 0) -> None:
        """The engine's own count of the request's tokens and finished choices, once it has ended:
        its response may have taken in fewer. Choices that did not finish (the client went away, the
        request was cut or failed) count as vLLM's "abort"."""
        self.num_produced = num_tokens
        if len(finish_reasons) > len(self.finish_reasons):
            self.finish_reasons = finish_reasons
        self.num_choices = num_choices

    def done(self) -> None:
        """Record the request's metrics and its log line; idempotent."""
        if self.logged:
            return
        self.logged = True
        m, now = self.metrics, time.perf_counter()
        generated = max(self.num_produced, self.num_delivered)
        m.prompt_tokens.inc(self.num_prompt_tokens)
        m.generation_tokens.inc(generated)
        for reason in self.finish_reasons:
            m.request_success.labels(reason).inc()
        aborted = self.num_choices - len(self.finish_reasons)
        if aborted > 0:
            m.request_success.labels("abort").inc(aborted)
        if self.first is not None:
            m.ttft.observe(self.first - self.arrival)
            if self.num_delivered > 1:
                m.request_tpot.observe((self.last - self.first) / (self.num_delivered - 1))
            if self.interval_sum:
                add_observations(m.itl, self.intervals, self.interval_sum)
                add_observations(m.tpot, self.intervals, self.interval_sum)
        m.e2e.observe(now - self.arrival)
        m.prompt_sizes.observe(self.num_prompt_tokens)
        m.params_n.observe(self.n)
        if self.max_tokens:
            m.params_max_tokens.observe(self.max_tokens)
        m.generation_sizes.observe(generated)
        if self.timing is not None and self.first is not None:
            queued, prefill = self.timing
            m.queue.observe(queued)
            m.prefill.observe(prefill)
            m.decode.observe(self.last - self.first)
            m.inference.observe(prefill + self.last - self.first)
        if m.log_requests:
            ttft = f"{1e3 * (self.first - self.arrival):.1f} ms" if self.first is not None else "-"
            unread = generated - self.num_delivered
            logger.info("request %s: %d prompt + %d generated tokens%s, TTFT %s, latency %.1f ms, finish %s",
                        self.request_id, self.num_prompt_tokens, generated,
                        f" ({unread} never sent: the client went away)" if unread else "", ttft,
                        1e3 * (now - self.arrival), ",".join(self.finish_reasons) or "none (cut short)")
