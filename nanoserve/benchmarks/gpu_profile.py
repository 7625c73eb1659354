"""Where the GPU time of a repeated call goes: kernels per call, busy time and the span they
cover (torch.profiler). Busy far below span means the host, not the GPU, sets the pace."""

from __future__ import annotations

from collections.abc import Callable

import torch


def print_gpu_profile(fn: Callable[[], object], calls: int = 20, top: int = 14, warmup: int = 3,
                      trace: str | None = None, gaps: int = 0) -> None:
    """Profile `calls` calls of fn (after `warmup`) and print per call: GPU ops, busy and span
    microseconds, then the `top` kernels by time; then the `gaps` longest stretches where the GPU
    sat idle inside a call, with the ops on either side. `trace`: a Chrome trace file to write."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    print_gpu_events([e for e in prof.events() if e.device_type == DeviceType.CUDA], calls, top, gaps)


def print_gpu_events(events: list, calls: int, top: int = 14, gaps: int = 0) -> None:
    """Per call: GPU ops, busy and span microseconds, the `top` kernels by time and the `gaps`
    longest idle stretches (events: a profile's CUDA events over `calls` calls)."""
    if not events:
        print("  no GPU work recorded")
        return
    busy: dict[str, list[float]] = {}
    for e in events:
        busy.setdefault(e.name[:90], []).append(e.time_range.elapsed_us())
    total = sum(sum(t) for t in busy.values()) / calls
    span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / calls
    print(f"  {len(events) / calls:.0f} GPU ops per call (kernels, copies, memsets), busy {total:.0f} us "
          f"of {span:.0f} us per call")
    for name, times in sorted(busy.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(times) / calls:8.1f} us/call {len(times) / calls:6.1f}/call  {name}")
    if gaps:
        print_idle_gaps(events, calls, gaps)


def print_idle_gaps(events: list, calls: int, count: int) -> None:
    """The `count` longest idle stretches between GPU ops, averaged over calls by the pair of ops
    around them (the gap between two calls, which the host spends returning and starting the next
    call, is one of them)."""
    ordered = sorted(events, key=lambda e: e.time_range.start)
    by_pair: dict[tuple[str, str], list[float]] = {}
    end = ordered[0].time_range.end
    for before, after in zip(ordered, ordered[1:]):
        end = max(end, before.time_range.end)
        idle = after.time_range.start - end
        if idle > 0:
            by_pair.setdefault((before.name[:50], after.name[:50]), []).append(idle)
    idle_total = sum(sum(t) for t in by_pair.values()) / calls
    print(f"  idle between GPU ops: {idle_total:.0f} us per call; longest:")
    for (before, after), times in sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:count]:
        print(f"  {sum(times) / calls:8.1f} us/call {len(times) / calls:6.1f}/call  {before} -> {after}")
