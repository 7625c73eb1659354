"""Paged prefill attention in Triton: packed variable-length queries over keys in the cache.

The keys of every sequence are read from the paged cache, so prefix-cache hits and the history
of a chunked prefill need no special case: query j of a sequence with q_len queries and seq_len
keys sits at position seq_len - q_len + j and sees keys 0..that position.

A sliding window (WINDOW keys, transformers' convention) keeps keys k with position - k < WINDOW:
whole key tiles before the window of a query tile's first row are not read, and the tiles that
only some rows' windows reach are masked. WINDOW 0 (no window) compiles the code of a model
without one.

One program per (sequence, tile of queries, kv head). A tile's rows are (token, head) pairs of
the kv head's query group, so each K/V tile is loaded once for the whole group (GQA). An fp8
cache is read as in triton_decode.

The grid covers every sequence times the longest query's tiles, or (`tiles`, for a captured graph
of many sequences) a list of (sequence, tile) programs staged by the host, `prefill_tiles`: a bucket
of T tokens over S sequences needs at most T / BLOCK_Q + S of them, where sequences x the longest
query could need S x T / BLOCK_Q programs. The list runs longest first and a tile's kv heads
launch side by side, so the waves after the first hold the short programs: the last wave ends
soon after the others instead of starting a long tile late.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from nanoserve.runner.attention import prefill_splits
from nanoserve.runner.attention.prefill_splits import unpack_entry
from nanoserve.runner.attention.fp8 import is_fp8
from nanoserve.runner.attention.kv_layout import tokens_contiguous
from nanoserve.runner.attention.triton_paged import (
    check_shapes, dot_precision, load_kv_block_tile, load_kv_tile, online_softmax_step, softmax_scale_log2,
    window_keys,
)
from nanoserve.runner.pdl import pdl_launch, pdl_prologue


@triton.jit
def _tile_scores(q, k_cache_ptr, v_cache_ptr, table, n0, offs_n, mask_n, kv_head, offs_d,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, scale_log2,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
                 V_TOKENS_CONTIGUOUS: tl.constexpr):
    """Base-2 scores of q against the tile of keys from n0 (a multiple of BLOCK_N), and the
    tile's values (an fp8 cache widened to q's dtype); masked keys of K read as 0, and of V too
    unless V's tokens are contiguous (then the tile lies in one block: kv_layout.py)."""
    if V_TOKENS_CONTIGUOUS:
        block = tl.load(table + n0 // BLOCK_SIZE).to(tl.int64)
        k, v = load_kv_block_tile(k_cache_ptr, v_cache_ptr, block, n0 % BLOCK_SIZE, mask_n, kv_head, offs_d,
                                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                                  BLOCK_N, True)
    else:
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, offs_n, mask_n, kv_head, offs_d,
                            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, BLOCK_SIZE)
    if KV_FP8:
        k, v = k.to(q.dtype), v.to(q.dtype)
    return tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2, v


# the block-table width changes with the batch: see _decode_kernel on specialization
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, tiles_ptr, ranges_ptr, part_acc_ptr, part_stats_ptr,
    scale_log2, v_scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bt, stride_qsl, stride_sl, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, KV_FP8: tl.constexpr, LAST_TILES_FIRST: tl.constexpr,
    SKIP_DECODE_ROWS: tl.constexpr, TILED: tl.constexpr, USE_PDL: tl.constexpr,
    V_TOKENS_CONTIGUOUS: tl.constexpr = False, WINDOW: tl.constexpr = 0, SPLIT: tl.constexpr = False,
    HEADS_FAST: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    if HEADS_FAST:   # a tile's kv heads launch side by side: grid (kv heads, tiles)
        kv_head = tl.program_id(0)
        entry = tl.program_id(1)
        kv_heads = tl.num_programs(0)
    else:
        kv_head = tl.program_id(2)
        entry = tl.program_id(0)
        kv_heads = tl.num_programs(2)
    if TILED:   # (sequence, slot, tile) from the host's list; -1 past its end
        packed = tl.load(tiles_ptr + entry)
        if packed < 0:
            return
        seq, slot, q_tile = unpack_entry(packed)   # slot 0: the whole tile; else a part (prefill_splits.py)
    else:
        slot = 0
        seq = entry
        q_tile = tl.program_id(1)
        if LAST_TILES_FIRST:   # causal: a late tile reads the most keys; started first, it ends no later
            q_tile = tl.num_programs(1) - 1 - q_tile
    q_start = tl.load(query_start_loc_ptr + seq * stride_qsl)
    q_len = tl.load(query_start_loc_ptr + (seq + 1) * stride_qsl) - q_start
    if q_tile * BLOCK_Q >= q_len:   # the grid is sized for the longest query of the batch
        return
    if SKIP_DECODE_ROWS and q_len == 1:   # the decode kernel's, in a mixed step
        return
    seq_len = tl.load(seq_lens_ptr + seq * stride_sl)
    history = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = q_tile * BLOCK_Q + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    mask_m = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    q_pos = history + tok

    if WINDOW > 0 or SPLIT:
        # a row's window may begin tiles after the first one read (a query tile longer than the
        # window), and a part's rows may see none of its keys: a finite start keeps the running
        # max finite over tiles a row sees nothing of
        m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    else:
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # keys up to the tile's last query position; every row sees key 0 (with a window, its own key),
    # so m turns finite
    end = history + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    if WINDOW > 0:   # rows past the query (unstored) attend as its last row: their window holds keys too
        q_pos = tl.minimum(q_pos, end - 1)
    # whole key tiles that every row of this tile sees (up to its first query's position) need
    # no causal mask; only the tiles along the diagonal do
    unmasked_end = tl.minimum((history + q_tile * BLOCK_Q + 1) // BLOCK_N * BLOCK_N, end)
    first_key = 0
    if SPLIT:
        if slot > 0:   # this part's keys only: whole tiles, up to the diagonal's
            first_key = tl.load(ranges_ptr + 2 * (slot - 1))
            end = tl.minimum(tl.load(ranges_ptr + 2 * (slot - 1) + 1), end)
            unmasked_end = tl.minimum(tl.maximum(unmasked_end, first_key), end)
    if WINDOW > 0:
        # a row at position p sees keys past p - WINDOW. No row sees the tiles before the first row's
        # window: they are skipped; from win_end on every row's window holds every key (up to the
        # diagonal); between them a tile is masked by the window alone (all of it precedes every row)
        first = tl.maximum(history + q_tile * BLOCK_Q - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        win_end = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(end - WINDOW, 0), BLOCK_N) * BLOCK_N, first),
                             unmasked_end)
        for n0 in range(first, win_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            qk, v = _tile_scores(q, k_cache_ptr, v_cache_ptr, table, n0, offs_n, offs_n < win_end, kv_head, offs_d,
                                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                                 scale_log2, BLOCK_SIZE, BLOCK_N, PRECISION, KV_FP8, V_TOKENS_CONTIGUOUS)
            qk = tl.where(offs_n[None, :] > q_pos[:, None] - WINDOW, qk, float("-inf"))
            m, l, acc = online_softmax_step(qk, v, m, l, acc, PRECISION)
    else:
        win_end = first_key
    for n0 in range(win_end, unmasked_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        qk, v = _tile_scores(q, k_cache_ptr, v_cache_ptr, table, n0, offs_n, offs_n < unmasked_end, kv_head, offs_d,
                             stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, scale_log2,
                             BLOCK_SIZE, BLOCK_N, PRECISION, KV_FP8, V_TOKENS_CONTIGUOUS)
        m, l, acc = online_softmax_step(qk, v, m, l, acc, PRECISION)
    for n0 in range(unmasked_end, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        qk, v = _tile_scores(q, k_cache_ptr, v_cache_ptr, table, n0, offs_n, offs_n < end, kv_head, offs_d,
                             stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, scale_log2,
                             BLOCK_SIZE, BLOCK_N, PRECISION, KV_FP8, V_TOKENS_CONTIGUOUS)
        if WINDOW > 0:
            seen = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - WINDOW)
        else:
            seen = offs_n[None, :] <= q_pos[:, None]
        qk = tl.where(seen, qk, float("-inf"))
        m, l, acc = online_softmax_step(qk, v, m, l, acc, PRECISION)

    if SPLIT:
        if slot > 0:   # the merge folds this part into its tile's rows
            at = ((slot - 1) * kv_heads + kv_head).to(tl.int64)
            tl.store(part_acc_ptr + at * BLOCK_M * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :], acc)
            tl.store(part_stats_ptr + at * 2 * BLOCK_M + offs_m, m)
            tl.store(part_stats_ptr + at * 2 * BLOCK_M + BLOCK_M + offs_m, l)
            return
    o = acc / l[:, None]
    if KV_FP8:
        o = o * v_scale
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def _tile_rows(block_m: int, group: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): a tile's rows, at least one query group, and the query tokens they hold."""
    block_m = max(block_m, triton.next_power_of_2(group))
    return block_m, block_m // group


def prefill_tile_rows(q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
                      ) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q) of the default tiles: a program's rows, and the query tokens they hold,
    which `prefill_tiles` counts in."""
    return _tile_rows(_prefill_config(head_dim, dtype, device)["BLOCK_M"], q_heads // kv_heads)


def prefill_block_q(q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """Query tokens per program (BLOCK_Q) of the default tiles, which `prefill_tiles` counts in."""
    return prefill_tile_rows(q_heads, kv_heads, head_dim, dtype, device)[1]


# a staged step lists its programs by the keys they read, most first, and launches a tile's kv heads
# side by side: a lone 2k-4k prompt's attention ran 20-37% faster on an H100, its TTFT 10-14% lower
# (BENCHMARKS.md); NANOSERVE_PREFILL_LONGEST_FIRST=0 restores sequence order, head by head
LONGEST_FIRST = os.environ.get("NANOSERVE_PREFILL_LONGEST_FIRST", "1") == "1"


def prefill_tiles(query_lens: Sequence[int], block_q: int, out: np.ndarray, seq_lens: np.ndarray | None = None) -> int:
    """Fill `out` (int32) with the (sequence, tile) programs of every sequence of more than one
    query (decode rows are paged_decode's), then -1; how many there are. Raises if they do not
    fit: `out` holds T / block_q + S entries for T tokens over S sequences. With `seq_lens` (each
    sequence's keys), the programs that read the most keys come first."""
    longest = max(query_lens, default=0)
    if len(query_lens) > 1 << (31 - prefill_splits.SEQ_SHIFT):
        raise ValueError(f"{len(query_lens)} sequences are more than a tiles entry holds")
    if -(-longest // block_q) > prefill_splits.TILE_FIELD + 1:
        raise ValueError(f"a query of {longest} tokens has more tiles than an entry holds")
    if len(query_lens) == 1:   # a lone prompt, the common graphed step: no vectorized fixed costs
        count = -(-longest // block_q) if longest > 1 else 0
        # sequence 0; a later tile reads more keys
        entries = np.arange(count - 1, -1, -1) if seq_lens is not None else np.arange(count)
    else:
        lens = np.asarray(query_lens, dtype=np.int64)
        per_seq = np.where(lens > 1, -(-lens // block_q), 0)
        count = int(per_seq.sum())
        seqs = np.repeat(np.arange(len(lens)), per_seq)
        tile = np.arange(count) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)   # 0, 1, ... within each sequence
        entries = (seqs << prefill_splits.SEQ_SHIFT) | tile
        if seq_lens is not None:
            entries = entries[np.argsort(-prefill_splits.keys_read(seqs, tile, lens, seq_lens, block_q), kind="stable")]
    if count > out.shape[0]:
        raise ValueError(f"{count} prefill tiles do not fit in {out.shape[0]}")
    out[:count] = entries
    out[count:] = -1
    return count


def _prefill_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    if device.type != "cuda":   # interpreter: small tiles keep masked work (and CPU time) low
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    if head_dim <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    if dtype.itemsize > 2 or head_dim > 128:
        # not swept past dim 128; 128 x 128 tiles of float32 (or of dim 256) overflow shared memory or spill
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    # bench/attention_kernels.py --prefill-sweep on an H200 (bf16, dim 128, group 2), TFLOP/s for
    # prompts of 1x1k / 4x1k / 1x4k / 1x16k: 106 / 178 / 234 / 328, against 103 / 173 / 215 / 282
    # for the 64 x 64 tiles on 4 warps used before. Over an fp8 cache with V along tokens (--v-layout,
    # one H100): 94.2 / 151.1 / 191.0 for 1x1k / 4x1k / 1x4k, against 82.2 / 141.3 / 168.1 on 64 x 64
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  block_tables: torch.Tensor, scale: float, max_query_len: int,
                  num_query_tokens: int | None = None, k_scale: float = 1.0,
                  v_scale: float = 1.0, config: dict | None = None,
                  skip_decode_rows: bool = False, tiles: torch.Tensor | None = None,
                  window: int | None = None, splits: prefill_splits.PrefillSplits | None = None) -> torch.Tensor:
    """Causal attention of packed queries q [tokens, q_heads, dim] over their paged keys.

    Rows past num_query_tokens (query_start_loc[-1], when the caller pads the batch) are zeroed.
    k_scale / v_scale apply to an fp8 cache only; config's keys replace the tile choice's (benchmarks, tests).
    skip_decode_rows: sequences of one query are left unwritten, for paged_decode to fill (a mixed step).
    tiles: the programs to run, from `prefill_tiles` with `prefill_block_q`'s tiles (or, with a
    config, with its BLOCK_Q); decode rows have none, as with skip_decode_rows.
    window: a sliding window's span: the query at position p attends keys p - window < k <= p (None: all).
    splits: the split plan `tiles` were staged with (prefill_splits.plan_splits) and its scratch;
    the parts' merge is launched after the kernel. Not with a window.
    """
    window = window_keys(window)
    check_shapes(q, k_cache, v_cache, block_tables)
    num_tokens, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    fp8 = is_fp8(k_cache)
    # launching the last query tiles first helped no default config (the prefill sweep): off unless asked
    cfg = {"LAST_TILES_FIRST": False, "HEADS_FAST": tiles is not None and LONGEST_FIRST,
           **_prefill_config(head_dim, q.dtype, q.device), **(config or {})}
    v_tokens = tokens_contiguous(v_cache)
    if v_tokens:   # such V is read a whole tile at a time, in tiles within one block (kv_layout.py)
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], block_size)
    block_m, block_q = _tile_rows(cfg.pop("BLOCK_M"), group)
    out = torch.empty_like(q)
    if num_query_tokens is not None and num_query_tokens < num_tokens:
        out[num_query_tokens:].zero_()
    num_seqs = seq_lens.shape[0]
    if tiles is not None:
        if tiles.dtype != torch.int32 or tiles.dim() != 1 or tiles.stride(0) != 1:
            raise ValueError("tiles: a contiguous int32 list from prefill_tiles")
        grid = (kv_heads, tiles.shape[0], 1) if cfg.get("HEADS_FAST") else (tiles.shape[0], 1, kv_heads)
        if splits is not None and (window or splits.acc.shape[2] != block_m
                                   or prefill_splits.split_unit(q.device) % cfg["BLOCK_N"]):
            raise ValueError("splits: no window, the default tiles' rows, parts of whole key tiles")
    else:
        if splits is not None:
            raise ValueError("splits need a staged tile list")
        if cfg.get("HEADS_FAST"):
            raise ValueError("HEADS_FAST needs a staged tile list")
        grid = (num_seqs, triton.cdiv(max_query_len, block_q), kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, tiles if tiles is not None else seq_lens,
        *((splits.ranges, splits.acc, splits.stats) if splits is not None else (seq_lens,) * 3),
        softmax_scale_log2(scale, k_scale if fp8 else 1.0), v_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0), query_start_loc.stride(0), seq_lens.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, PRECISION=dot_precision(q.dtype), KV_FP8=fp8, SKIP_DECODE_ROWS=skip_decode_rows,
        TILED=tiles is not None, V_TOKENS_CONTIGUOUS=v_tokens, WINDOW=window, SPLIT=splits is not None,
        **cfg, **pdl_launch(q.device),
    )
    if splits is not None:
        prefill_splits.merge_parts(splits, query_start_loc, out, group, block_q, block_m, fp8, v_scale)
    return out
