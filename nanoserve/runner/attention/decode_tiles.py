"""The paged decode kernel's tiles (BLOCK_N, warps, stages) by cache kind, dtype and head size,
as swept on the device (BENCHMARKS.md), and the switch that replaces them for A/B runs."""

from __future__ import annotations

import functools
import os

import torch


def decode_config(device: torch.device, fp8: bool = False, dtype: torch.dtype = torch.bfloat16,
                  head_dim: int = 128, v_tokens_contiguous: bool = True) -> dict:
    """The decode kernel's tiles. v_tokens_contiguous: an fp8 cache's V lies as the engine lays it
    out (kv_layout.py), or (False) row by row as K."""
    tiles = _default_tiles(device, fp8, dtype, head_dim, v_tokens_contiguous)
    return {**tiles, **tiles_asked(fp8)} if device.type == "cuda" else tiles


@functools.lru_cache(maxsize=None)
def tiles_asked(fp8: bool) -> dict:
    """Decode tiles over a cache of this kind as NANOSERVE_DECODE_TILES_FP8 / _BF16 asks ("BLOCK_N,warps,stages"
    and optionally ",maxnreg", a cap on registers a thread; read once), for A/B runs of the workload; none
    asked: the defaults."""
    value = os.environ.get("NANOSERVE_DECODE_TILES_FP8" if fp8 else "NANOSERVE_DECODE_TILES_BF16")
    if not value:
        return {}
    return tile_config(*(int(part) for part in value.split(",")))


def tile_config(block_n: int, warps: int, stages: int, maxnreg: int | None = None) -> dict:
    """paged_decode's config keys for these tiles; maxnreg caps registers a thread."""
    return dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))


def _default_tiles(device: torch.device, fp8: bool, dtype: torch.dtype, head_dim: int,
                   v_tokens_contiguous: bool) -> dict:
    if device.type != "cuda":   # interpreter: small tiles keep masked work (and CPU time) low; the loop is the GPU's
        return dict(BLOCK_N=16, num_warps=1, num_stages=1, BLOCK_AHEAD=fp8)
    if fp8 and (dtype.itemsize > 2 or head_dim > 128):
        # not swept. One warp would spill: float32 queries widen the cache to float32 (a 64-key
        # tile of K alone in 256 registers a thread), and at dim 256 the accumulator and the
        # tiles pass 255. At dim 256 two stages of 128 float32 keys overflow shared memory.
        return dict(BLOCK_N=128, num_warps=4, num_stages=2) if head_dim <= 128 else \
            dict(BLOCK_N=64, num_warps=4, num_stages=1)
    if fp8 and v_tokens_contiguous:
        # bench/attention_kernels.py --v-layout on an H200, TB/s of K+V read (ragged batches of 256 /
        # 128, batch 256 at 1k, batch 1 at 2k): 3.39 / 2.93 / 3.68 / 0.30, against 3.11 / 2.27 / 3.43 /
        # 0.19 for V row by row on its best tiles (below). A V tile of 128 keys reads whole 128-byte
        # lines; 64 keys on one warp read half lines and lost (2.68 / 2.22 / 2.89 / 0.22).
        return dict(BLOCK_N=128, num_warps=4, num_stages=2, BLOCK_AHEAD=True)
    if fp8:
        # V row by row. bench/attention_kernels.py --fp8-sweep on an H200: batch 256 at 1k / 8k, batch
        # 16 at 8k. Widening to f16 makes the kernel issue-bound, not memory-bound; one warp a program
        # needs no cross-warp reductions per tile and holds fewer registers, so more programs share
        # an SM: 176 / 1,270 / 99 us a layer, against 231 / 1,778 / 128 for 128 keys on 4 warps.
        # With each tile's block read a tile ahead, two stages pipeline the loads (--ahead): 3.07 ->
        # 3.40 TB/s at batch 256, 1k; 2.71 -> 2.94 over ragged contexts (BENCHMARKS.md)
        return dict(BLOCK_N=64, num_warps=1, num_stages=2, BLOCK_AHEAD=True)
    # best of BLOCK_N 32/64/128 x warps 4/8 x stages 2/3/4 at batch 256 on an H200 (bf16, dim 128)
    return dict(BLOCK_N=64, num_warps=4, num_stages=3)
