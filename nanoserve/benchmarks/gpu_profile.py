"""Where the GPU time of a repeated call goes: kernels per call, busy time and the span they
cover (torch.profiler). Busy far below span means the host, not the GPU, sets the pace."""

from __future__ import annotations

from collections.abc import Callable

import torch


def print_gpu_profile(fn: Callable[[], object], calls: int = 20, top: int = 14, warmup: int = 3) -> None:
    """Profile `calls` calls of fn (after `warmup`) and print per call: GPU ops, busy and span
    microseconds, then the `top` kernels by time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
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
