"""Summing a split-K GEMM's float32 partials [split, rows, N] in split order, deterministically.

The skinny GEMM's programs (small_gemm.py) each write their split's partial. The last split of a
tile to finish, counted with an atomic, sums the tile's partials (and adds the bias), then resets
its count for the next call: one launch. Where that cannot run (more tiles than the counters,
programs past SUM_IN_LAST_MAX_ROWS rows, a graph capture before the counters exist) a second
kernel sums them, with the same bits. At 4-32 rows that kernel took ~3.6 us a layer's linear,
as long as the matmul's own. fp32 atomics into a zeroed buffer would need three launches
(memset, matmul, cast) and sum in a varying order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.runner.pdl import pdl_launch, pdl_prologue

SUM_IN_LAST_SPLIT = True   # split K: the last split of a tile sums the partials (else a second kernel)
# up to this many rows a program: decode steps of 4 / 8 / 16 rows took 1.2-1.9% less time with the sum
# in the last split, and 32 rows 2.4% more (one H200, BENCHMARKS.md)
SUM_IN_LAST_MAX_ROWS = 16
TILE_COUNTS = 1 << 16      # tiles the split counters cover; a call with more sums in a second kernel


@triton.jit
def sum_if_last(first_part, split_stride, out_ptr, bias_ptr, counts_ptr, tile, offs_m, offs_n, mask, N,
                SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Count this split of the tile done; the last one sums every split's partial in split order
    into out (+ bias) and sets the count back to 0. The barrier and the count's acquire-release
    order every thread's partial before the count that reports it (a semaphore, as in split-K
    GEMMs that reduce in place); the sums read L2 (.cg), where the other SMs' partials are."""
    tl.debug_barrier()
    done = tl.atomic_add(counts_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if done == SPLIT_K - 1:
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in tl.static_range(SPLIT_K):
            total += tl.load(first_part + s * split_stride + offs_m[:, None] * N + offs_n[None, :], mask=mask,
                             other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(counts_ptr + tile, 0)   # the next call (or graph replay) starts from 0


@triton.jit(do_not_specialize=["MN"])
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLIT_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):   # split order, every call: the result is deterministic
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def split_partials(splits: int, rows: int, n: int, device: torch.device) -> torch.Tensor:
    """Room for each split's float32 partial: every one is written before any is summed."""
    return torch.empty(splits, rows, n, dtype=torch.float32, device=device)


_tile_counts: dict[torch.device, torch.Tensor] = {}


def tile_counts(device: torch.device, block_m: int, tiles: int) -> torch.Tensor | None:
    """The device's split counters, zeroed once and left at zero by every call that uses them, for
    a split launch of `tiles` tiles of block_m rows; None where its last splits do not sum (see the
    module's text), or while a graph is being captured before they exist (a zeroing would be
    captured too)."""
    if not SUM_IN_LAST_SPLIT or block_m > SUM_IN_LAST_MAX_ROWS or tiles > TILE_COUNTS:
        return None
    counts = _tile_counts.get(device)
    if counts is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        counts = _tile_counts[device] = torch.zeros(TILE_COUNTS, dtype=torch.int32, device=device)
    return counts


def sum_splits(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = the sum of part [split, rows, N] over its splits, in order (+ bias [N]), in a kernel of its own."""
    splits, m, n = part.shape
    block = 1024
    _sum_splits_kernel[(triton.cdiv(m * n, block),)](
        part, bias if bias is not None else part, out, m * n, n, SPLIT_K=splits,
        HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **pdl_launch(out.device),
    )
