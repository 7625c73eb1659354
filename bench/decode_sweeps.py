"""Decode-attention sweeps over launch layouts (bench/attention_kernels.py --ragged, --launch-order):
split counts and launch order over ragged contexts, and a sequence's kv heads side by side, for
both caches. TB/s of K+V read; each variant's output is
checked against the default kernel's."""

from __future__ import annotations

import torch
from attention_common import BLOCK, DTYPE, HEAD_DIM, KV_HEADS, Caches, graph_time_us

from nanoserve.runner.attention.decode_splits import FP8_SPLIT_KEYS, longest_first
from nanoserve.runner.attention.decode_tiles import tile_config
from nanoserve.runner.attention.fp8 import FP8_DTYPE
from nanoserve.runner.attention.kv_layout import v_cache_copy
from nanoserve.runner.attention.triton_decode import paged_decode


def ragged_sweep(q_heads: int) -> None:
    """Decode over contexts of unequal length, as in a served batch (nano-vllm's workload: prompts
    of 100-1,024 tokens, outputs of 100-1,024): KV bandwidth by how contexts are split (evenly in
    1/2/4, or in splits of 256/512 keys) and launch order (rows / longest first), for each cache
    dtype and, for fp8, a few tiles. Each variant's output is checked against the default's."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    splits = [dict(num_splits=n) for n in (1, 2, 4)] + [dict(split_keys=k) for k in (256, 512, 1024)]
    print("\nragged decode (TB/s of K+V read), contexts uniform in 100..2,048; "
          "s<n>: n even splits, k<n>: splits of n keys; L: longest first")
    for dtype, configs in ((DTYPE, [None]),
                           # the default, and one warp without the block read ahead (the default before bf39b02)
                           (FP8_DTYPE, [None, dict(num_stages=1, BLOCK_AHEAD=False), dict(num_stages=3)])):
        caches = Caches(256 * 2048, dtype)
        for batch in (64, 128, 256):
            seq_lens = torch.randint(100, 2049, (batch,), generator=gen, device="cuda", dtype=torch.int32)
            per_seq = -(-2048 // BLOCK)
            tables = torch.randperm(caches.num_blocks, device="cuda")[:batch * per_seq].view(batch, per_seq).int()
            q = torch.randn(batch, q_heads, HEAD_DIM, dtype=DTYPE, device="cuda")
            nbytes = 2 * int(seq_lens.sum()) * KV_HEADS * HEAD_DIM * caches.k.element_size()
            order = longest_first(seq_lens)
            expected = paged_decode(q, caches.k, caches.v, seq_lens, tables, HEAD_DIM ** -0.5, 2048)
            for config in configs:
                cells = []
                for split in splits:
                    for ordered in (False, True):
                        run = (lambda: paged_decode(q, caches.k, caches.v, seq_lens, tables, HEAD_DIM ** -0.5, 2048,
                                                    seq_order=order if ordered else None, config=config, **split))
                        err = (run().float() - expected.float()).abs().max().item()
                        us = graph_time_us(run)
                        name = f"s{split['num_splits']}" if "num_splits" in split else f"k{split['split_keys']}"
                        cells.append(f"{name}{'L' if ordered else ' '} {nbytes / us / 1e6:4.2f}{'!' if err > 2e-2 else ' '}")
                label = f"{str(dtype).split('.')[-1]} {config or 'default'}"
                print(f"{label:>45} b{batch:<3} " + " ".join(cells))
    print("! = differs from the default by more than 2e-2")


def decode_shapes(cases, q_heads: int) -> list[tuple]:
    """(name, batch, q, seq_lens, order, split) per case (name, batch, context, split): a context of
    None draws ragged ones, uniform in 100-2,048, launched longest first; others are uniform."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = []
    for name, batch, lens, split in cases:
        seq_lens = (torch.randint(100, 2049, (batch,), generator=gen, device="cuda", dtype=torch.int32)
                    if lens is None else torch.full((batch,), lens, device="cuda", dtype=torch.int32))
        q = torch.randn(batch, q_heads, HEAD_DIM, dtype=DTYPE, device="cuda")
        shapes.append((name, batch, q, seq_lens, longest_first(seq_lens) if lens is None else None, split))
    return shapes


def decode_cases(shapes, caches: Caches, fp8_ragged_split: bool = False, split_keys: int = 512) -> list[tuple]:
    """(q, seq_lens, tables, order, split, the default kernel's output, K+V bytes) per shape, over
    fresh shuffled blocks of `caches`; fp8_ragged_split: an fp8 cache's ragged cases in splits of
    split_keys keys, as the engine runs them."""
    cases = []
    for _, batch, q, seq_lens, order, split in shapes:
        per_seq = -(-2048 // BLOCK)
        tables = torch.randperm(caches.num_blocks, device="cuda")[:batch * per_seq].view(batch, per_seq).int()
        if fp8_ragged_split and order is not None and caches.k.dtype == FP8_DTYPE:
            split = dict(split_keys=split_keys)
        nbytes = 2 * int(seq_lens.sum()) * KV_HEADS * HEAD_DIM * caches.k.element_size()
        want = paged_decode(q, caches.k, caches.v, seq_lens, tables, HEAD_DIM ** -0.5, 2048, seq_order=order, **split)
        cases.append((q, seq_lens, tables, order, split, want, nbytes))
    return cases


def bandwidth_cells(caches: Caches, cases: list[tuple], cfg: dict, width: int) -> list[str]:
    """TB/s of K+V read per case under config cfg, marked ! where the output differs from the
    default kernel's by more than 2e-2."""
    cells = []
    for q, seq_lens, tables, order, split, want, nbytes in cases:
        run = (lambda q=q, seq_lens=seq_lens, tables=tables, order=order, split=split:
               paged_decode(q, caches.k, caches.v, seq_lens, tables, HEAD_DIM ** -0.5, 2048,
                            seq_order=order, config=dict(cfg), **split))
        err = (run().float() - want.float()).abs().max().item()
        cells.append(f"{nbytes / graph_time_us(run) / 1e6:{width}.2f}{'!' if err > 2e-2 else ' '}")
    return cells


def tile_line(label: str, caches: Caches, cases: list[tuple], cfg: dict) -> None:
    """One sweep line: bandwidth_cells under cfg, or why the config failed to run."""
    try:
        print(f"{label:>34} " + " ".join(bandwidth_cells(caches, cases, cfg, 11)), flush=True)
    except Exception as e:   # out of registers or shared memory
        print(f"{label:>34} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)


# (name, batch, context or None for ragged, split) of the launch-layout sweeps
LAYOUT_CASES = (("ragged b256", 256, None, {}), ("ragged b128", 128, None, {}), ("b256 c1k", 256, 1024, {}),
                ("b64 c2k", 64, 2048, {}), ("b16 c2k", 16, 2048, {}), ("b1 c2k", 1, 2048, {}))


def launch_order_sweep(q_heads: int) -> None:
    """Decode programs launched sequence by sequence with a sequence's kv heads side by side
    (H: they share each token's cache row) against head by head (-), for both caches and a few
    tiles: TB/s of K+V read on ragged batches (as the engine launches them: longest first; an fp8
    cache in splits of 512 keys) and uniform ones."""
    shapes = decode_shapes(LAYOUT_CASES, q_heads)
    print("\nlaunch order (TB/s of K+V read); H: a sequence's kv heads side by side")
    print(f"{'cache BLOCK_N warps stages order':>34} " + " ".join(f"{c[0]:>12}" for c in shapes))
    for dtype, tiles in ((DTYPE, ((64, 4, 3), (64, 2, 2), (32, 4, 3))),
                         (FP8_DTYPE, ((64, 1, 1), (64, 2, 2), (32, 1, 2), (64, 1, 2)))):
        caches = Caches(256 * 2048, dtype)
        cases = decode_cases(shapes, caches, fp8_ragged_split=True)
        for block_n, warps, stages in tiles:
            for heads_fast in (False, True):
                cfg = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages, HEADS_FAST=heads_fast)
                label = f"{str(dtype).split('.')[-1][:8]} {block_n:4d} {warps} {stages} {'H' if heads_fast else '-'}"
                print(f"{label:>34} " + " ".join(bandwidth_cells(caches, cases, cfg, 11)))
    print("! = differs from the default by more than 2e-2")


def ahead_sweep(q_heads: int) -> None:
    """The decode loop reading the block table per key (-) against each tile's block read as one
    index a tile ahead (A), for both caches and a few tiles: TB/s of K+V read on ragged batches (as
    the engine launches them) and uniform ones."""
    shapes = decode_shapes(LAYOUT_CASES, q_heads)
    print(f"\nreading each tile's block ahead (TB/s of K+V read), {q_heads} q heads")
    print(f"{'cache BLOCK_N warps stages ahead':>34} " + " ".join(f"{c[0]:>12}" for c in shapes))
    for dtype, tiles in ((DTYPE, ((64, 4, 3, False), (64, 4, 3, True), (64, 4, 2, True))),
                         (FP8_DTYPE, ((64, 1, 1, False), (64, 1, 2, False), (64, 1, 1, True), (64, 1, 2, True),
                                      (64, 1, 3, True), (32, 1, 2, True), (128, 1, 2, True), (64, 2, 2, True),
                                      (128, 2, 2, True)))):
        caches = Caches(256 * 2048, dtype)
        cases = decode_cases(shapes, caches, fp8_ragged_split=True)
        for block_n, warps, stages, ahead in tiles:
            cfg = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages, BLOCK_AHEAD=ahead)
            tile_line(f"{str(dtype).split('.')[-1][:8]} {block_n:4d} {warps} {stages} {'A' if ahead else '-'}",
                      caches, cases, cfg)
    print("! = differs from the default by more than 2e-2")


def v_layout_sweep(q_heads: int) -> None:
    """An fp8 cache's V row by row (as K) against with each (kv head, dim)'s tokens contiguous
    (kv_layout.py), over a few tiles: TB/s of K+V read on ragged batches (longest first, splits of
    FP8_SPLIT_KEYS) and uniform ones; each output checked against the row-by-row default's."""
    shapes = decode_shapes(LAYOUT_CASES, q_heads)
    caches = Caches(256 * 2048, FP8_DTYPE, engine_layout=False)
    cases = decode_cases(shapes, caches, fp8_ragged_split=True, split_keys=FP8_SPLIT_KEYS)
    rows = caches.v
    tokens = v_cache_copy(rows)
    print(f"\nfp8 V layout (TB/s of K+V read), {q_heads} q heads")
    print(f"{'V BLOCK_N warps stages':>34} " + " ".join(f"{c[0]:>12}" for c in shapes))
    for layout, v, tiles in (("rows", rows, ((64, 1, 2),)),
                             ("tokens", tokens, ((64, 1, 2), (64, 2, 3), (128, 2, 2), (128, 4, 2), (128, 4, 3),
                                                 (128, 8, 2), (256, 4, 2), (256, 8, 2), (128, 4, 2, 128),
                                                 (128, 4, 3, 128), (128, 4, 2, 96)))):
        caches.v = v
        for block_n, warps, stages, *cap in tiles:   # cap: registers a thread (maxnreg)
            cfg = dict(tile_config(block_n, warps, stages, *cap), BLOCK_AHEAD=True)
            tile_line(f"{layout} {block_n:4d} {warps} {stages}{f' r{cap[0]}' if cap else ''}", caches, cases, cfg)
    print("! = differs from the row-by-row default by more than 2e-2")

