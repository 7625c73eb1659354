"""How many threads torch computes with on the CPU.

OpenMP's threads meet at a barrier after every op, so one thread taken off its core stalls all of
them. A process that works beside the compute (the server's front end, another tensor-parallel
rank) must not share the compute's cores. On a 2-core machine serving the bundled model at 16
concurrent streams, the engine made 643 tokens a second on one thread against 528 on two, and 27
on two while a third process was busy (BENCHMARKS.md, CPU serving). A container's CPU quota
(`docker run --cpus 2`) is not a core count torch sees: it would start a thread per host core.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> int | None:
    """CPUs' worth of time the cgroup quota allows, rounded up (cgroup v2, then v1); None: no quota."""
    try:
        quota, period = (Path(root) / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (Path(root) / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (Path(root) / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:   # "max": no quota
        return None
    return max(1, math.ceil(quota_us / period_us)) if quota_us > 0 and period_us > 0 else None


def cpu_compute_threads(tensor_parallel_size: int = 1, reserved: int = 0) -> int | None:
    """Threads for each rank: torch's default count (at most the cgroup's CPU quota) less `reserved`
    cores kept for other work, shared among the ranks. None where torch's own count stands: nothing
    to share and no quota below it, or OMP_NUM_THREADS set."""
    if os.environ.get("OMP_NUM_THREADS") or tensor_parallel_size < 1:   # the engine's config refuses a size < 1
        return None
    cores, limit = torch.get_num_threads(), cgroup_cpu_limit()
    if limit is not None and limit < cores:
        cores = limit
    elif tensor_parallel_size == 1 and reserved == 0:
        return None
    return max(1, (cores - reserved) // tensor_parallel_size)
