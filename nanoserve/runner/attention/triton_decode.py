"""Paged decode attention in Triton: one query token per sequence, GQA, split-K.

Stage 1 runs one program per (sequence, kv head, split). It reads the K/V of its share of the
context once and attends all the query heads of its group to it. A sequence whose keys fit one
split has its output written directly; with several it writes a partial (normalized acc,
log-sum-exp) per split to a float32 workspace, and stage 2 merges the splits of each (sequence,
head). (Merging in the last
split program to finish, counted with an atomic, was slower on an H200: BENCHMARKS.md.)
How contexts are split, and the engine's choices, are decode_splits'.

CUDA-graph safe: the number of splits and the workspace size depend only on host values that
are fixed for a captured graph (batch, heads, the caller's max_seq_len, the device). Each
sequence divides its own context over the splits inside the kernel, evenly, or (split_keys) in
splits of a fixed number of keys, the last taking whatever remains; so any seq_len up to the
cache's length is handled by any split count. Splits past a sequence's end read and write
nothing: the merge counts a sequence's splits from its length. A padding row (seq_len 0) comes
out as zeros.

A sliding window (WINDOW keys: the query at position p = seq_len - 1 sees keys k with
p - k < WINDOW, transformers' convention) reads keys [max(0, seq_len - WINDOW), seq_len): the
splits divide the tiles from the one holding the window's first key, so that no split lies wholly
before the window, and the merge counts them the same way. WINDOW 0 (no window) compiles the code
of a model without one.

An fp8 cache (attention/fp8.py) is widened to q's dtype tile by tile; its scales cost nothing
per key: k_scale folds into the softmax scale and v_scale into the output.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from nanoserve.runner.attention.decode_splits import decode_split_count, split_span
from nanoserve.runner.attention.decode_tiles import decode_config
from nanoserve.runner.attention.fp8 import is_fp8
from nanoserve.runner.attention.kv_layout import tokens_contiguous
from nanoserve.runner.attention.triton_paged import (
    check_new_v, check_shapes, dot_precision, load_kv_block_tile, load_kv_tile, online_softmax_step, prefetch_kv_tile,
    softmax_scale_log2, store_v_sectors, window_keys,
)
from nanoserve.runner.attention.triton_rope_store import check_rope, rope_kernel_args, rope_new_token
from nanoserve.runner.layers.rotary import NewTokenRope
from nanoserve.runner.pdl import pdl_launch, pdl_prologue


@triton.jit
def _query_row(query_start_ptr, seq, PACKED_Q: tl.constexpr):
    """The q and output row of sequence `seq`: `seq` itself, or in a mixed step's packed rows its
    query start, and -1 where the sequence has more than one query (a prompt's chunk)."""
    if PACKED_Q:
        first = tl.load(query_start_ptr + seq)
        return tl.where(tl.load(query_start_ptr + seq + 1) - first == 1, first, -1)
    return seq


@triton.jit
def _window_first_tile(seq_len, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where the tile of the window's first key (seq_len - WINDOW, or 0) starts: the splits' origin."""
    return tl.maximum(seq_len - WINDOW, 0) // BLOCK_N * BLOCK_N


@triton.jit
def _split_tiles(seq_len, num_splits, split_tiles, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """(the sequence's tiles of BLOCK_N keys, from its first or with a window from its window's
    first tile, tiles per split): split_tiles where given, else the tiles divided evenly over
    num_splits; at least 1."""
    if WINDOW > 0:
        tiles = tl.cdiv(seq_len - _window_first_tile(seq_len, WINDOW, BLOCK_N), BLOCK_N)
    else:
        tiles = tl.cdiv(seq_len, BLOCK_N)
    per = tl.where(split_tiles > 0, split_tiles, tl.cdiv(tiles, num_splits))
    return tiles, tl.maximum(per, 1)


@triton.jit
def _attend_tile(q, k, v, mask_n, m, l, acc, scale_log2, KV_FP8: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys (masked ones left out) folded into (m, l, acc); every tile holds at least
    one key of its split (a window's first tile too: it holds the window's first key), so m stays
    finite."""
    if KV_FP8:
        k, v = k.to(q.dtype), v.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    return online_softmax_step(qk, v, m, l, acc, PRECISION)


# Ints that change from step to step are not specialized: Triton would otherwise compile a new
# variant when one equals 1 or turns a multiple of 16 (a block-table width of 1 in a short warm-up,
# 16 in a long batch), and that compile would land in the middle of serving.
@triton.jit(do_not_specialize=["num_splits", "split_tiles", "stride_bt"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, seq_order_ptr, query_start_ptr,
    out_ptr, part_acc_ptr, part_lse_ptr,
    scale_log2, v_scale, num_splits, split_tiles,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bt, stride_sl, stride_ot, stride_oh,
    cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, norm_eps, inv_k_scale, inv_v_scale, stride_cos,
    new_v_ptr, stride_nvt, stride_nvh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr, KV_FP8: tl.constexpr, FP8_VIA_F16: tl.constexpr,
    ORDERED: tl.constexpr, PACKED_Q: tl.constexpr, HEADS_FAST: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_AHEAD: tl.constexpr = False, V_TOKENS_CONTIGUOUS: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 0,
    ROPE: tl.constexpr = False, NORM: tl.constexpr = False, Q_HEADS: tl.constexpr = 0,
    NEW_V: tl.constexpr = False, SECTOR: tl.constexpr = 32, WINDOW: tl.constexpr = 0,
):
    # lengths, order, query starts and block tables are staged by the host, never written by a
    # kernel of the step: they may be read before waiting on the kernel ahead (PDL); q and the cache may not
    if HEADS_FAST:   # grid (kv heads, sequences, splits): a sequence's heads start side by side
        kv_head, seq, kv_heads = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    else:
        seq, kv_head, kv_heads = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    if ORDERED:   # programs start in launch order: the longest sequences first leave no long tail
        seq = tl.load(seq_order_ptr + seq)
    q_row = _query_row(query_start_ptr, seq, PACKED_Q)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq * stride_sl)
    # splits start on tile bounds; the last one ends at seq_len, however long the context
    tiles, per_split = _split_tiles(seq_len, num_splits, split_tiles, BLOCK_N, WINDOW)
    start = tl.multiple_of(split * per_split * BLOCK_N, BLOCK_N)
    if WINDOW > 0:   # the splits start from the window's first tile; keys before `lo` are masked in it
        lo = tl.maximum(seq_len - WINDOW, 0)
        start = tl.multiple_of(_window_first_tile(seq_len, WINDOW, BLOCK_N) + start, BLOCK_N)
    end = tl.where(split == num_splits - 1, seq_len, tl.minimum(start + per_split * BLOCK_N, seq_len))
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if PREFETCH_LINES > 0:
        # the first tile's lines start on their way to the L2 while the kernel ahead (the step's KV
        # store) still runs: at small batches a program's whole work is a tile or two, and the
        # latency of its first loads is most of its time
        prefetch_kv_tile(k_cache_ptr, v_cache_ptr, table, start, tl.where(q_row < 0, start, end), kv_head,
                         stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                         BLOCK_N, BLOCK_SIZE, HEAD_DIM, PREFETCH_LINES, V_TOKENS_CONTIGUOUS)
    pdl_prologue(USE_PDL)   # every program waits, even one with nothing to do: see pdl.py
    if q_row < 0:   # a prompt's row of a mixed step: the prefill kernel's
        return
    if SPLIT and start >= seq_len:   # past the end (padding rows too): the merge leaves it out
        return

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    if ROPE:   # q_ptr is the packed q/k/v projection: see rope_new_token
        q = rope_new_token(q_ptr + q_row.to(tl.int64) * stride_qt, seq_len, start, end, kv_head, heads, mask_h,
                           table, cos_ptr, sin_ptr, stride_cos, q_norm_ptr, k_norm_ptr, norm_eps,
                           k_cache_ptr, v_cache_ptr, inv_k_scale, inv_v_scale, stride_kb, stride_kt, stride_kh,
                           stride_vb, stride_vt, stride_vh, stride_vd, Q_HEADS, Q_HEADS // GROUP,
                           HEAD_DIM, BLOCK_SIZE, NORM, KV_FP8).to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None], other=0.0)
    if NEW_V:   # the program whose keys hold the row's new position stores its v there first
        pos = seq_len - 1
        if (pos >= start) & (pos < end):
            store_v_sectors(new_v_ptr + seq.to(tl.int64) * stride_nvt + kv_head * stride_nvh, v_cache_ptr,
                            tl.load(table + pos // BLOCK_SIZE).to(tl.int64), pos, kv_head, offs_d, inv_v_scale,
                            stride_vb, stride_vh, stride_vd, BLOCK_SIZE, SECTOR)
            tl.debug_barrier()   # its sectors are seen by every thread of the program below
    if KV_FP8 and FP8_VIA_F16:
        # e4m3 widens to f16 in one instruction per pair (to bf16 it takes several); a bf16 q
        # loses no mantissa in f16, and attention queries stay far inside f16's range
        q = q.to(tl.float16)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    # empty when the split lies past seq_len (padding rows included): nothing is read
    if BLOCK_AHEAD and BLOCK_N <= BLOCK_SIZE:   # else a tile spans blocks: the table is read per key
        # a tile lies in one block (tiles start on multiples of BLOCK_N), so its block is one
        # scalar, read a tile ahead: the K/V loads wait on no table read, and the pipeliner can
        # start the next tile's loads early. Past `end` the read is masked.
        offs_t = tl.arange(0, BLOCK_N)
        block = tl.load(table + start // BLOCK_SIZE, mask=start < end, other=0).to(tl.int64)
        for n0 in range(start, end, BLOCK_N):
            mask_n = n0 + offs_t < end
            if WINDOW > 0:
                mask_n = mask_n & (n0 + offs_t >= lo)
            block_next = tl.load(table + (n0 + BLOCK_N) // BLOCK_SIZE, mask=n0 + BLOCK_N < end,
                                 other=0).to(tl.int64)
            k, v = load_kv_block_tile(k_cache_ptr, v_cache_ptr, block, n0 % BLOCK_SIZE, mask_n, kv_head, offs_d,
                                      stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                                      BLOCK_N, V_TOKENS_CONTIGUOUS)
            m, l, acc = _attend_tile(q, k, v, mask_n, m, l, acc, scale_log2, KV_FP8, PRECISION)
            block = block_next
    else:
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            if WINDOW > 0:
                mask_n = mask_n & (offs_n >= lo)
            k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, offs_n, mask_n, kv_head, offs_d,
                                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                                BLOCK_SIZE)
            m, l, acc = _attend_tile(q, k, v, mask_n, m, l, acc, scale_log2, KV_FP8, PRECISION)

    has_keys = l > 0
    l = tl.where(has_keys, l, 1.0)
    o = acc / l[:, None]   # no keys: acc is 0, so o is 0
    if KV_FP8:
        o = o * v_scale   # the merge of splits is linear in o: scaling each partial suffices
    # a context that fits one split needs no merge: its one partial is its output, bit for bit
    if SPLIT and tiles > per_split:
        row = (seq * kv_heads * GROUP + heads) * num_splits + split
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=mask_h[:, None])
        tl.store(part_lse_ptr + row, tl.where(has_keys, m + tl.log2(l), float("-inf")),
                 mask=mask_h)
    else:
        tl.store(out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None])


@triton.jit(do_not_specialize=["num_splits", "split_tiles"])
def _merge_splits_kernel(
    part_acc_ptr, part_lse_ptr, out_ptr, seq_lens_ptr, query_start_ptr, num_splits, split_tiles, stride_sl,
    stride_ot, stride_oh, Q_HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    SPLITS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, PACKED_Q: tl.constexpr, USE_PDL: tl.constexpr,
    WINDOW: tl.constexpr = 0,
):
    # one program merges BLOCK_HEADS heads of a sequence: a program per head was thousands of
    # programs of a few hundred bytes each at large batches (8B, fp8 splits: 28 us a layer)
    seq = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    pdl_prologue(USE_PDL)
    q_row = _query_row(query_start_ptr, seq, PACKED_Q)
    if q_row < 0:
        return
    offs_s = tl.arange(0, SPLITS_POW2)
    offs_d = tl.arange(0, HEAD_DIM)
    # the splits that hold keys, as the decode kernel divided the context
    tiles, per_split = _split_tiles(tl.load(seq_lens_ptr + seq * stride_sl), num_splits, split_tiles, BLOCK_N,
                                    WINDOW)
    if tiles > 0 and tiles <= per_split:   # one split with keys: it wrote the output itself
        return
    mask_h = offs_h < Q_HEADS
    mask = mask_h[:, None] & (offs_s < tl.minimum(tl.cdiv(tiles, per_split), num_splits))[None, :]
    row = (seq * Q_HEADS + offs_h[:, None]) * num_splits + offs_s[None, :]   # [heads, splits]
    lse = tl.load(part_lse_ptr + row, mask=mask, other=float("-inf"))
    lse_max = tl.max(lse, 1)
    # a padding row has no split with keys: every lse reads as -inf and the output is 0
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max[:, None])
    denom = tl.sum(w, 1)
    acc = tl.load(part_acc_ptr + row[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                  mask=mask[:, :, None], other=0.0)
    o = tl.sum(w[:, :, None] * acc, 1) / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + q_row * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None])


MERGE_TILE = 8192   # float32 partials a merge program holds: 64 a thread on 4 warps


def merge_heads_per_program(q_heads: int, splits_pow2: int, head_dim: int) -> int:
    """Heads one merge program takes: as many as MERGE_TILE holds at this split width, at least one."""
    return max(1, min(triton.next_power_of_2(q_heads), MERGE_TILE // (splits_pow2 * head_dim)))


PREFETCH_FIRST_TILE = True


def prefetch_lines(device: torch.device, head_dim: int, elem_bytes: int) -> int:
    """128-byte lines in a key row for the first tile's L2 prefetch, 0 for none: off in the
    interpreter, which runs no inline PTX, and over an fp8 cache, whose one-warp programs lost
    ~10% of the 256-sequence workload's throughput to it (33,055 against 36,445 tok/s on an H200)."""
    if device.type != "cuda" or not PREFETCH_FIRST_TILE or elem_bytes == 1:
        return 0
    lines = max(1, head_dim * elem_bytes // 128)
    return 1 << (lines.bit_length() - 1)   # a power of two, as tl.arange takes


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                 max_seq_len: int, num_splits: int | None = None,
                 config: dict | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0, seq_order: torch.Tensor | None = None,
                 split_keys: int | None = None, query_start_loc: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, rope: NewTokenRope | None = None,
                 new_v: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Attention of one query per sequence, q [batch, q_heads, dim], over its paged keys.

    max_seq_len only sizes the split count (pass max_model_len when capturing a graph);
    seq_lens may later hold any value up to the cache's capacity. num_splits and config
    override the heuristics (benchmarks, tests; config's keys replace the default tiles' one
    by one). k_scale / v_scale apply to an fp8 cache only. seq_order, a permutation of the rows
    (longest first: `longest_first(seq_lens)`), is the order their programs start in; the
    output is the same. split_keys: every split but a sequence's last takes this many keys
    (rounded up to whole tiles), and the split count covers max_seq_len, instead of each context
    being divided evenly; a ragged batch's long contexts then spread over more programs.
    query_start_loc (a mixed step): q and the output hold packed rows, [tokens, q_heads, dim];
    only sequences of one query are computed, into `out`, and the other rows are left as they are.
    rope (a decode-only step): q is the q columns of the packed projection, [batch, (q_heads +
    2 kv_heads) * dim] seen as [batch, q_heads, dim]; the kernel norms and rotates q and k at each
    row's position (seq_len - 1) and stores the row's k and v in the cache before reading it: the
    store of _qkv_rope_store_kernel, without its launch.
    new_v (a decode-only step over an fp8 cache whose V lies along tokens): each row's new v,
    [batch, kv_heads, head_dim], not yet in the cache (qkv_rope_store(store_v=False) stored its k);
    the kernel stores it, a whole sector a dim (triton_paged.store_v_sectors), before reading.
    window: a sliding window's span: each row attends its last `window` keys only (None: all).
    """
    _, q_heads, head_dim = q.shape
    batch = q.shape[0] if query_start_loc is None else seq_lens.shape[0]
    _, block_size, kv_heads, _ = k_cache.shape
    check_shapes(q, k_cache, v_cache, block_tables)
    if query_start_loc is not None and (query_start_loc.shape != (batch + 1,) or query_start_loc.stride(0) != 1
                                        or out is None):
        raise ValueError("a mixed step passes query_start_loc of its sequences + 1 and the output to fill")
    if block_tables.shape[0] != batch:
        raise ValueError(f"decode expects one query per sequence; got {batch} queries for "
                         f"{block_tables.shape[0]} block tables")
    if seq_order is not None and (seq_order.shape != (batch,) or seq_order.dtype != torch.int32
                                  or seq_order.stride(0) != 1):
        raise ValueError(f"seq_order must be a contiguous int32 permutation of the {batch} rows")
    if rope is not None:
        check_rope(rope, q, kv_heads, query_start_loc)
    window = window_keys(window)
    group = q_heads // kv_heads
    fp8 = is_fp8(k_cache)
    v_tokens = tokens_contiguous(v_cache)
    if new_v is not None:
        check_new_v(new_v, v_cache, batch, plain_decode=query_start_loc is None and rope is None)
    cfg = {**decode_config(q.device, fp8, q.dtype, head_dim, v_tokens), **(config or {})}
    # e4m3 widens to f16 in one instruction per pair, to bf16 in several: a bf16 q goes to f16
    cfg.setdefault("FP8_VIA_F16", fp8 and q.dtype == torch.bfloat16)
    if v_tokens:   # such V is read a whole tile at a time, in tiles within one block (kv_layout.py)
        cfg.setdefault("BLOCK_AHEAD", True)
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], block_size)
    span = split_span(split_keys, cfg["BLOCK_N"])
    split_tiles = span // cfg["BLOCK_N"]   # 0: the kernels' flag for even division
    if num_splits is None:
        # a window's keys lie in the tiles from the one holding its first: at most window + BLOCK_N - 1
        keys = min(max_seq_len, window + cfg["BLOCK_N"] - 1) if window else max_seq_len
        num_splits = decode_split_count(batch, kv_heads, keys, q.device, span, fp8)
    out = q.new_empty(q.shape) if out is None else out
    packed = query_start_loc is not None
    split = num_splits > 1
    if split:
        part_acc = torch.empty(batch, q_heads, num_splits, head_dim, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_lse = out   # unused
    heads_fast = cfg.pop("HEADS_FAST", heads_fast_enabled())
    grid = (kv_heads, batch, num_splits) if heads_fast else (batch, kv_heads, num_splits)
    _decode_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens,
        seq_order if seq_order is not None else seq_lens,   # unread unless ORDERED
        query_start_loc if packed else seq_lens,            # unread unless PACKED_Q
        out, part_acc, part_lse,
        softmax_scale_log2(scale, k_scale if fp8 else 1.0), v_scale, num_splits, split_tiles,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0), seq_lens.stride(0), out.stride(0), out.stride(1),
        *rope_kernel_args(rope, q, k_scale, v_scale),
        new_v if new_v is not None else q, *(new_v.stride()[:2] if new_v is not None else (0, 0)),
        NEW_V=new_v is not None, SECTOR=min(32, block_size), ROPE=rope is not None, NORM=rope is not None and rope.q_weight is not None, Q_HEADS=q_heads,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, SPLIT=split, PRECISION=dot_precision(q.dtype), KV_FP8=fp8,
        ORDERED=seq_order is not None, PACKED_Q=packed, HEADS_FAST=heads_fast, V_TOKENS_CONTIGUOUS=v_tokens,
        WINDOW=window, PREFETCH_LINES=prefetch_lines(q.device, head_dim, k_cache.element_size()), **cfg,
        **pdl_launch(q.device),
    )
    if split:
        splits_pow2 = triton.next_power_of_2(num_splits)
        heads = merge_heads_per_program(q_heads, splits_pow2, head_dim)
        _merge_splits_kernel[(batch, triton.cdiv(q_heads, heads))](
            part_acc, part_lse, out, seq_lens, query_start_loc if packed else seq_lens, num_splits, split_tiles,
            seq_lens.stride(0), out.stride(0), out.stride(1), Q_HEADS=q_heads, BLOCK_HEADS=heads, HEAD_DIM=head_dim,
            SPLITS_POW2=splits_pow2, BLOCK_N=cfg["BLOCK_N"], PACKED_Q=packed, WINDOW=window, num_warps=4,
            **pdl_launch(q.device),
        )
    return out


@functools.lru_cache(maxsize=None)
def heads_fast_enabled() -> bool:
    """Whether a sequence's kv heads are launched side by side (NANOSERVE_DECODE_HEADS_FAST=0 to
    launch head by head). They read the same cache rows, each its own head's share; head by head,
    the programs running at once each took one head's 128-256 bytes of every 1-2 KB row. On an
    H200 over ragged contexts: 3.84 -> 4.16 TB/s (bf16), 2.49 -> 2.74 (fp8) at batch 256;
    3.18 -> 3.91 (bf16) at 128 (BENCHMARKS.md, launch order)."""
    return os.environ.get("NANOSERVE_DECODE_HEADS_FAST", "1") == "1"
