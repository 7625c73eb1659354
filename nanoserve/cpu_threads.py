"""How many threads torch computes with on the CPU.

OpenMP's threads meet at a barrier after every op, so one thread taken off its core stalls all of
them. A process that works beside the compute (the server's front end, another tensor-parallel
rank) must not share the compute's cores. On a 2-core machine serving the bundled model at 16
concurrent streams, the engine made 643 tokens a second on one thread against 528 on two, and 27
on two while a third process was busy (BENCHMARKS.md, CPU serving).
"""

from __future__ import annotations

import os

import torch


def cpu_compute_threads(tensor_parallel_size: int = 1, reserved: int = 0) -> int | None:
    """Threads for each rank: torch's default count less `reserved` cores kept for other work,
    shared among the ranks. None where nothing needs sharing, or where OMP_NUM_THREADS is set:
    then torch's own count stands."""
    if os.environ.get("OMP_NUM_THREADS") or (tensor_parallel_size == 1 and reserved == 0):
        return None
    return max(1, (torch.get_num_threads() - reserved) // tensor_parallel_size)
