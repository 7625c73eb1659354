"""The paged decode kernel's dots over one tile of keys: the query against K, the probabilities
against V, folded into the running softmax. An fp8 cache is widened to the query's dtype for
16-row tensor-core dots (the default), or (E4M3_DOTS) both dots take e4m3 operands as they are, the
query rounded by its row's scale: Hopper's warp-group MMA then reads the cache's bytes from shared
memory. On an H200 that was no faster (BENCHMARKS.md, "Both fp8 decode dots on e4m3 operands"):
an opt-in for A/B runs, decode_tiles.e4m3_dots_asked."""

from __future__ import annotations

import triton
import triton.language as tl

from nanoserve.runner.attention.fp8 import FP8_MAX
from nanoserve.runner.attention.triton_fp8 import to_fp8
from nanoserve.runner.attention.triton_paged import online_softmax_step

_FP8_MAX = tl.constexpr(FP8_MAX)
# probabilities (at most 1) times 256 keep e4m3's relative precision down to 2**-14 and stay under 448
P_SCALE = tl.constexpr(256.0)


@triton.jit
def quantize_query(q, scale_log2, dtype: tl.constexpr):
    """(q in e4m3 by each row's own scale, which puts its largest element at e4m3's largest; that
    scale times scale_log2, per row)."""
    q_scale = tl.maximum(tl.max(tl.abs(q.to(tl.float32)), 1), 1e-30) * (1.0 / _FP8_MAX)
    return to_fp8(q, 1.0 / q_scale[:, None], dtype), q_scale * scale_log2


@triton.jit
def attend_tile(q, k, v, mask_n, m, l, acc, scale_log2, KV_FP8: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys (masked ones left out) folded into (m, l, acc); every tile holds at least
    one key of its split (a window's first tile too: it holds the window's first key), so m stays
    finite."""
    if KV_FP8:
        k, v = k.to(q.dtype), v.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    return online_softmax_step(qk, v, m, l, acc, PRECISION)


@triton.jit
def attend_tile_e4m3(q8, k, v, mask_n, m, l, acc, row_scale_log2):
    """attend_tile with both dots on e4m3 operands, as the tensor cores take them: q8 is the query
    quantized per row (row_scale_log2 = its scale times the softmax's), and the probabilities go to
    e4m3 times P_SCALE, so that the smallest that count stay normal numbers."""
    qk = tl.dot(q8, tl.trans(k)) * row_scale_log2[:, None]
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(to_fp8(p, P_SCALE, k.dtype), v)
    return m_new, l, acc


@triton.jit
def fold_tile(q, k, v, mask_n, m, l, acc, scale_log2, row_scale, KV_FP8: tl.constexpr, E4M3_DOTS: tl.constexpr,
               PRECISION: tl.constexpr):
    """One tile folded into (m, l, acc) by the kernel's dots: widened (the default), or on e4m3 operands."""
    if KV_FP8 and E4M3_DOTS == 2:
        m, l, acc = attend_tile_e4m3_keys(q, k, v, mask_n, m, l, acc, row_scale)
    elif KV_FP8 and E4M3_DOTS:
        m, l, acc = attend_tile_e4m3(q, k, v, mask_n, m, l, acc, row_scale)
    else:
        m, l, acc = attend_tile(q, k, v, mask_n, m, l, acc, scale_log2, KV_FP8, PRECISION)
    return m, l, acc


@triton.jit
def attend_tile_e4m3_keys(q8, k, v, mask_n, m, l, acc_t, row_scale_log2):
    """attend_tile_e4m3 transposed: the keys are the dots' rows, so a warp group's 64-row MMA is
    filled by keys, not by a GQA group padded with empty heads. Scores [BLOCK_N, heads];
    acc_t [HEAD_DIM, heads]."""
    s_t = tl.dot(k, tl.trans(q8)) * row_scale_log2[None, :]
    s_t = tl.where(mask_n[:, None], s_t, float("-inf"))
    m_new = tl.maximum(m, tl.max(s_t, 0))
    alpha = tl.exp2(m - m_new)
    p_t = tl.exp2(s_t - m_new[None, :])
    l = l * alpha + tl.sum(p_t, 0)
    acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v), to_fp8(p_t, P_SCALE, k.dtype))
    return m_new, l, acc_t
