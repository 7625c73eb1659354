"""Paged decode that reads the cache in whole rows: one program per (sequence, split) attends
every q head of the sequence.

The cache lays a token's kv heads side by side, so a tile of BLOCK_N tokens x all kv heads is
one contiguous stretch of a block. Its (token, head) rows enter one dot as BLOCK_N * KV_HEADS
keys, and each q head's scores against another kv head's keys are masked out: the dot's q rows
are the sequence's q heads, where the per-head kernel (triton_decode) pads a GQA group of 2-4
rows to 16, so the tensor-core work per key is the same.

Same contract as triton_decode's kernel: the split arithmetic, the partials' layout for the
merge kernel, padding rows, mixed steps' packed rows and launch order. Needs a power-of-two
number of kv heads (a tile's columns are an arange).
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanoserve.runner.attention.triton_paged import decode_program, online_softmax_step, write_decode_result
from nanoserve.runner.pdl import pdl_prologue


@triton.jit(do_not_specialize=["num_splits", "split_tiles", "stride_bt"])
def decode_rows_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, seq_order_ptr, query_start_ptr,
    out_ptr, part_acc_ptr, part_lse_ptr,
    scale_log2, v_scale, num_splits, split_tiles,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt, stride_sl, stride_ot, stride_oh,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr, KV_FP8: tl.constexpr, FP8_VIA_F16: tl.constexpr,
    ORDERED: tl.constexpr, PACKED_Q: tl.constexpr, USE_PDL: tl.constexpr,
):
    split = tl.program_id(1)
    seq, q_row, start, end, table, idle = decode_program(
        tl.program_id(0), split, seq_order_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr, num_splits,
        split_tiles, stride_sl, stride_bt, BLOCK_N, ORDERED, PACKED_Q, SPLIT)
    pdl_prologue(USE_PDL)   # every program waits, even one with nothing to do: see pdl.py
    if idle:
        return

    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_h = heads < KV_HEADS * GROUP
    q = tl.load(q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None], other=0.0)
    if KV_FP8 and FP8_VIA_F16:
        q = q.to(tl.float16)   # as in triton_decode: e4m3 widens to f16 cheaply
    cols = tl.arange(0, BLOCK_N * KV_HEADS)   # column c: token c // KV_HEADS of the tile, kv head c % KV_HEADS
    col_head = cols % KV_HEADS
    # a q head scores only its own kv head's keys; padding rows (q of 0) score all, so m stays finite
    own = ((heads // GROUP)[:, None] == col_head[None, :]) | (~mask_h)[:, None]
    k_head = col_head * stride_kh
    v_head = col_head * stride_vh

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + cols // KV_HEADS
        mask_c = tok < end
        block = tl.load(table + tok // BLOCK_SIZE, mask=mask_c, other=0).to(tl.int64)
        within = tok % BLOCK_SIZE
        k = tl.load(k_cache_ptr + (block * stride_kb + within * stride_kt + k_head)[:, None] + offs_d[None, :],
                    mask=mask_c[:, None], other=0.0)
        v = tl.load(v_cache_ptr + (block * stride_vb + within * stride_vt + v_head)[:, None] + offs_d[None, :],
                    mask=mask_c[:, None], other=0.0)
        if KV_FP8:
            k, v = k.to(q.dtype), v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        qk = tl.where(own & mask_c[None, :], qk, float("-inf"))
        # every tile holds at least one token of this split, so every row at least one key
        m, l, acc = online_softmax_step(qk, v, m, l, acc, PRECISION)

    write_decode_result(acc, m, l, q_row, seq * KV_HEADS * GROUP + heads, mask_h, split, num_splits, v_scale,
                        out_ptr, part_acc_ptr, part_lse_ptr, heads, offs_d, stride_ot, stride_oh,
                        HEAD_DIM, SPLIT, KV_FP8)


def rows_config(interpreted: bool, fp8: bool, kv_heads: int) -> dict:
    """Tiles of the whole-row kernel: tokens per tile (BLOCK_N) so that a tile holds 128 (token,
    head) rows, or 16 under the interpreter. Not yet swept on a GPU."""
    if interpreted:
        return dict(BLOCK_N=max(1, 16 // kv_heads), num_warps=1, num_stages=1)
    return dict(BLOCK_N=max(1, 128 // kv_heads), num_warps=4, num_stages=2 if fp8 else 3)


def rows_fit(kv_heads: int, block_n: int) -> bool:
    """Whether the whole-row kernel takes this shape: a tile's columns are an arange, so a power
    of two, and at least 16 of them for the dot."""
    return (kv_heads & (kv_heads - 1)) == 0 and block_n * kv_heads >= 16
