"""Programmatic dependent launch (PDL, Hopper and later) for the step's Triton kernels: on by
default on such GPUs, off with NANOSERVE_PDL=0. On an H200 it cut the pipelined batch-1 decode step
from 1.145 to 1.051 ms and changed batch 256 by nothing (`bench/gpu_suite.sh pdl`, BENCHMARKS.md).

A kernel launched with PDL may be scheduled while the kernel ahead of it in the stream still
runs. In a CUDA graph of a few hundred small kernels that hides part of the gap between one
kernel's end and the next one's start. Each kernel that takes part calls `pdl_prologue` before it
touches memory: it waits until the kernel ahead has finished and its writes are visible
(griddepcontrol.wait), then lets the kernel behind it be scheduled. A kernel launched without PDL
(cuBLAS, torch's own) waits for ours as stream order always had it.

Every program calls the prologue, even one with nothing to do (a decode split past its sequence's
end, a prompt's row in a mixed step's decode launch) that returns right after: a launch none of
whose programs waited could finish before the kernel ahead, and the kernel behind it would then
read memory still being written. Only reads of what no kernel of the step writes (weights, the
host-staged lengths and tables) may come before it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def pdl_enabled(device: torch.device) -> bool:
    """On a GPU of compute capability 9.0 or later, unless NANOSERVE_PDL=0."""
    if os.environ.get("NANOSERVE_PDL", "1") == "0" or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch: the kernel's USE_PDL, and Triton's launch_pdl where on
    (only then: a Triton without PDL knows no such option)."""
    if pdl_enabled(device):
        return dict(USE_PDL=True, launch_pdl=True)
    return dict(USE_PDL=False)
