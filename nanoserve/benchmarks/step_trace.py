"""Where a benchmark's time goes, step by step: wall time per engine step (split into steps that
launched prompt tokens and decode-only steps, as nano-vllm's harness reports prefill and decode
time) and a torch.profiler window.

Used by bench/throughput.py (--trace DIR). Tracing runs its own generation after the timed one,
so the number the benchmark prints is never measured under the profiler.
"""

from __future__ import annotations

import gzip
import os
import shutil
import statistics
import time
from collections import defaultdict

from torch.profiler import ProfilerActivity, profile, schedule


class StepTrace:
    """Wraps engine.step: records each step's wall time and batch size, profiles steps [skip, skip + count)."""

    def __init__(self, engine, out_dir: str, skip: int = 300, count: int = 20) -> None:
        self.engine, self.out_dir = engine, out_dir
        self.times: list[tuple[int, float, bool]] = []  # (running sequences, seconds, launched prompt tokens)
        self._prefill = False
        self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                schedule=schedule(wait=skip, warmup=3, active=count, repeat=1),
                                on_trace_ready=self._write_profile)
        self._step = engine.step
        self._forward = engine.runner.forward

    def __enter__(self) -> StepTrace:
        os.makedirs(self.out_dir, exist_ok=True)
        self.engine.step = self._timed_step
        self.engine.runner.forward = self._classified_forward
        self.profiler.start()
        return self

    def __exit__(self, *exc) -> None:
        self.profiler.stop()
        self.engine.step = self._step
        self.engine.runner.forward = self._forward
        self._write_step_times()

    def _classified_forward(self, work):
        self._prefill = any(w.num_new > 1 or w.params is None for w in work)
        return self._forward(work)

    def _timed_step(self):
        running = self.engine.num_running
        self._prefill = False
        start = time.perf_counter()
        outputs = self._step()
        self.times.append((running, time.perf_counter() - start, self._prefill))
        self.profiler.step()
        return outputs

    def _write_profile(self, prof) -> None:
        averages = prof.key_averages()
        with open(os.path.join(self.out_dir, "profile.txt"), "w") as f:
            f.write(averages.table(sort_by="self_cuda_time_total", row_limit=40) + "\n")
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
        trace = os.path.join(self.out_dir, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace)

    def _write_step_times(self) -> None:
        by_batch: dict[int, list[float]] = defaultdict(list)
        for running, seconds, prefill in self.times:
            if not prefill:
                by_batch[(running + 63) // 64 * 64].append(seconds)  # buckets of 64 sequences
        prefill = [t for _, t, p in self.times if p]
        lines = [f"{len(self.times)} steps, {sum(t for _, t, _ in self.times):.2f} s: "
                 f"{len(prefill)} launching prompt tokens in {sum(prefill):.2f} s, the rest decode only",
                 "decode-only steps by running count",
                 "running<=  steps  total_s  median_ms  p90_ms"]
        for bucket in sorted(by_batch):
            times = sorted(by_batch[bucket])
            lines.append(f"{bucket:9d} {len(times):6d} {sum(times):8.2f} {1e3 * statistics.median(times):10.2f} "
                         f"{1e3 * times[int(0.9 * (len(times) - 1))]:7.2f}")
        text = "\n".join(lines)
        print(text)
        with open(os.path.join(self.out_dir, "step_times.txt"), "w") as f:
            f.write(text + "\n")
