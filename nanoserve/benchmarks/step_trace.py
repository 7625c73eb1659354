"""Where a benchmark's time goes, step by step: wall time per engine step (split into steps that
launched prompt tokens and decode-only steps, as nano-vllm's harness reports prefill and decode
time), how long the host waited for the device's sampled ids (a step that waits ~0 left the GPU
idle: the host set the pace), and a torch.profiler window with the GPU's busy time and idle gaps.

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

from nanoserve.benchmarks.gpu_profile import print_gpu_events
from nanoserve.runner.model_runner import PendingSample


class StepTrace:
    """Wraps engine.step: records each step's wall time and batch size, profiles steps [skip, skip + count)."""

    def __init__(self, engine, out_dir: str, skip: int = 300, count: int = 20) -> None:
        self.engine, self.out_dir = engine, out_dir
        self.times: list[tuple[int, float, bool, float]] = []  # (running, seconds, launched prompt tokens, waited)
        self.count = count
        self._waited = 0.0
        self._prefill = False
        self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                schedule=schedule(wait=skip, warmup=3, active=count, repeat=1),
                                on_trace_ready=self._write_profile)
        self._step = engine.step
        self._forward = engine.runner.forward
        self._result = PendingSample.result

    def __enter__(self) -> StepTrace:
        os.makedirs(self.out_dir, exist_ok=True)
        self.engine.step = self._timed_step
        self.engine.runner.forward = self._classified_forward
        PendingSample.result = self._timed_result(self._result)
        self.profiler.start()
        return self

    def __exit__(self, *exc) -> None:
        self.profiler.stop()
        self.engine.step = self._step
        self.engine.runner.forward = self._forward
        PendingSample.result = self._result
        self._write_step_times()

    def _classified_forward(self, work):
        self._prefill = any(w.num_new > 1 or w.params is None for w in work)
        return self._forward(work)

    def _timed_result(self, result):
        def timed(pending):
            start = time.perf_counter()
            out = result(pending)
            self._waited += time.perf_counter() - start
            return out
        return timed

    def _timed_step(self):
        running = self.engine.num_running
        self._prefill, self._waited = False, 0.0
        start = time.perf_counter()
        outputs = self._step()
        self.times.append((running, time.perf_counter() - start, self._prefill, self._waited))
        self.profiler.step()
        return outputs

    def _write_profile(self, prof) -> None:
        from torch.autograd import DeviceType
        print(f"profiled window ({self.count} steps):")
        print_gpu_events([e for e in prof.events() if e.device_type == DeviceType.CUDA], self.count, top=10, gaps=6)
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
        by_batch: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for running, seconds, prefill, waited in self.times:
            if not prefill:
                by_batch[(running + 63) // 64 * 64].append((seconds, waited))  # buckets of 64 sequences
        prefill = [t for _, t, p, _ in self.times if p]
        total, waited = sum(t[1] for t in self.times), sum(t[3] for t in self.times)
        lines = [f"{len(self.times)} steps, {total:.2f} s: "
                 f"{len(prefill)} launching prompt tokens in {sum(prefill):.2f} s, the rest decode only; "
                 f"the host waited for the device {waited:.2f} s, and under 50 us in "
                 f"{sum(t[3] < 50e-6 for t in self.times)} steps (the device idles there)",
                 "decode-only steps by running count",
                 "running<=  steps  total_s  median_ms  p90_ms  median_host_ms  waits<50us"]
        for bucket in sorted(by_batch):
            steps = by_batch[bucket]
            times = sorted(t for t, _ in steps)
            host = statistics.median(t - w for t, w in steps)
            lines.append(f"{bucket:9d} {len(times):6d} {sum(times):8.2f} {1e3 * statistics.median(times):10.2f} "
                         f"{1e3 * times[int(0.9 * (len(times) - 1))]:7.2f} {1e3 * host:15.2f} "
                         f"{sum(w < 50e-6 for _, w in steps):10d}")
        text = "\n".join(lines)
        print(text)
        with open(os.path.join(self.out_dir, "step_times.txt"), "w") as f:
            f.write(text + "\n")
