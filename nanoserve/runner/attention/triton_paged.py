"""The inner loop that paged decode and prefill share: a K/V tile through the block table, and
one online-softmax step over it. Inlined into both kernels by Triton."""

from __future__ import annotations

import triton
import triton.language as tl

from nanoserve.runner.attention.triton_fp8 import to_fp8


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, table, offs_n, mask_n, kv_head, offs_d,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 BLOCK_SIZE: tl.constexpr):
    """K and V of key positions offs_n ([BLOCK_N, HEAD_DIM] each); masked keys read as 0."""
    block = tl.load(table + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    tok = offs_n % BLOCK_SIZE
    k = tl.load(k_cache_ptr + block[:, None] * stride_kb + tok[:, None] * stride_kt
                + kv_head * stride_kh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    v = tl.load(v_cache_ptr + block[:, None] * stride_vb + tok[:, None] * stride_vt
                + kv_head * stride_vh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    return k, v


@triton.jit
def online_softmax_step(qk, v, m, l, acc, PRECISION: tl.constexpr, P_FP8: tl.constexpr = False):
    """Fold one tile of base-2 scores (masked ones -inf) and its values into (m, l, acc).
    Each row must see at least one unmasked key per tile, so m stays finite.

    P_FP8 (v an e4m3 tile): the probabilities enter the dot in e4m3 too, so v is read as stored.
    They are taken times 2**8, which keeps the small ones clear of e4m3's subnormals; l carries
    the same factor, so acc / l is unchanged."""
    m_new = tl.maximum(m, tl.max(qk, 1))
    alpha = tl.exp2(m - m_new)
    if P_FP8:
        p = tl.exp2(qk - m_new[:, None] + 8.0)
        pv = tl.dot(to_fp8(p, 1.0, v.dtype), v)
    else:
        p = tl.exp2(qk - m_new[:, None])
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + pv
    return m_new, l, acc
