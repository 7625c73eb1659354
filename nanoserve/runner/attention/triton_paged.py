"""The inner loop that paged decode and prefill share: a K/V tile through the block table, and
one online-softmax step over it. Inlined into both kernels by Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, table, offs_n, mask_n, kv_head, offs_d,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 BLOCK_SIZE: tl.constexpr):
    """K and V of key positions offs_n ([BLOCK_N, HEAD_DIM] each); masked keys read as 0."""
    block = tl.load(table + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    return load_kv_rows(k_cache_ptr, v_cache_ptr, block, offs_n % BLOCK_SIZE, mask_n, kv_head, offs_d,
                        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh)


@triton.jit
def load_kv_rows(k_cache_ptr, v_cache_ptr, block, tok, mask_n, kv_head, offs_d,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh):
    """K and V of tokens `tok` of physical block(s) `block` (one per token, or one for the whole
    tile), [BLOCK_N, HEAD_DIM] each; masked keys read as 0."""
    k_rows = block * stride_kb + tok * stride_kt + kv_head * stride_kh
    v_rows = block * stride_vb + tok * stride_vt + kv_head * stride_vh
    k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    return k, v


@triton.jit
def online_softmax_step(qk, v, m, l, acc, PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores (masked ones -inf) and its values into (m, l, acc).
    Each row must see at least one unmasked key per tile, so m stays finite."""
    m_new = tl.maximum(m, tl.max(qk, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc
