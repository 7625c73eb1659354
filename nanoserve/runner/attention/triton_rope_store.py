"""One kernel from the packed q/k/v projection to attention's inputs: per-head RMSNorm of q and k
(Qwen3) when weights are given, rotary on both (GPT-NeoX layout), q written out, k and v written
straight to their cache slots (quantized for an fp8 cache). It replaces the q/k norm + rotary
kernel and the KV store kernel of each layer: one launch instead of two, and k/v never
round-trip through memory. Numerically it is ops.qkv_rope + store_kvcache in float32 math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.runner.attention.fp8 import is_fp8
from nanoserve.runner.attention.triton_paged import store_kv_rows
from nanoserve.runner.layers.rotary import NewTokenRope
from nanoserve.runner.pdl import pdl_launch, pdl_prologue


@triton.jit
def _norm_rope(row, offs_h, mask_h, offs_d, partner, sign, cos, sin, weight_ptr, eps,
               NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Heads offs_h of one token ([heads, HEAD_DIM] at `row`), normed and rotated, in float32."""
    x = tl.load(row + offs_h[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_h[:, None],
                other=0.0).to(tl.float32)
    # rotate_half: element d pairs with d +- HEAD_DIM / 2, the first half negated
    x_partner = tl.load(row + offs_h[:, None] * HEAD_DIM + partner[None, :], mask=mask_h[:, None],
                        other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        x = x * rstd * tl.load(weight_ptr + offs_d).to(tl.float32)[None, :]
        x_partner = x_partner * rstd * tl.load(weight_ptr + partner).to(tl.float32)[None, :]
    return x * cos[None, :] + sign[None, :] * x_partner * sin[None, :]


@triton.jit
def _qkv_rope_store_kernel(
    qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, q_out_ptr,
    k_cache_ptr, v_cache_ptr, slot_mapping_ptr, eps, inv_k_scale, inv_v_scale,
    stride_qkv, stride_pos, stride_cos, stride_qo, stride_slot, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_vd,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_POW2: tl.constexpr,
    KV_HEADS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr, STORE_V: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token * stride_pos).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    half: tl.constexpr = HEAD_DIM // 2
    partner = (offs_d + half) % HEAD_DIM
    sign = tl.where(offs_d < half, -1.0, 1.0)
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d)
    sin = tl.load(sin_ptr + pos * stride_cos + offs_d)
    row = qkv_ptr + token.to(tl.int64) * stride_qkv

    offs_h = tl.arange(0, HEADS_POW2)
    mask_h = offs_h < HEADS
    q = _norm_rope(row, offs_h, mask_h, offs_d, partner, sign, cos, sin, q_weight_ptr, eps,
                   NORM, HEAD_DIM)
    tl.store(q_out_ptr + token.to(tl.int64) * stride_qo + offs_h[:, None] * HEAD_DIM
             + offs_d[None, :], q.to(q_out_ptr.dtype.element_ty), mask=mask_h[:, None])

    slot = tl.load(slot_mapping_ptr + token * stride_slot).to(tl.int64)
    if slot >= 0:   # -1 marks a padding token: it writes nothing
        offs_kh = tl.arange(0, KV_HEADS_POW2)
        mask_kh = offs_kh < KV_HEADS
        k = _norm_rope(row + HEADS * HEAD_DIM, offs_kh, mask_kh, offs_d, partner, sign, cos, sin,
                       k_weight_ptr, eps, NORM, HEAD_DIM)
        v = tl.load(row + (HEADS + KV_HEADS) * HEAD_DIM + offs_kh[:, None] * HEAD_DIM
                    + offs_d[None, :], mask=mask_kh[:, None])
        store_kv_rows(k, v, slot, offs_kh, mask_kh, offs_d, k_cache_ptr, v_cache_ptr, inv_k_scale, inv_v_scale,
                      stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd, BLOCK_SIZE, KV_FP8,
                      STORE_V)


@triton.jit
def rope_new_token(row, seq_len, start, end, kv_head, heads, mask_h, table, cos_ptr, sin_ptr, stride_cos,
                   q_weight_ptr, k_weight_ptr, eps, k_cache_ptr, v_cache_ptr, inv_k_scale, inv_v_scale,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                   HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr, KV_FP8: tl.constexpr):
    """Inside decode attention: a decode row's query `heads` from its packed projection `row`,
    normed and rotated at the row's position (seq_len - 1), in float32. The program whose keys
    [start, end) hold that position first stores its kv head's k and v there, as
    _qkv_rope_store_kernel stores them, and waits for its own threads' stores before it reads the
    cache. No other program reads that key: kv heads and splits each read their own keys."""
    pos = (seq_len - 1).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    half: tl.constexpr = HEAD_DIM // 2
    partner = (offs_d + half) % HEAD_DIM
    sign = tl.where(offs_d < half, -1.0, 1.0)
    at = tl.maximum(pos, 0) * stride_cos   # a padding row (seq_len 0) is rotated as position 0 and attends nothing
    cos = tl.load(cos_ptr + at + offs_d)
    sin = tl.load(sin_ptr + at + offs_d)
    q = _norm_rope(row, heads, mask_h, offs_d, partner, sign, cos, sin, q_weight_ptr, eps, NORM, HEAD_DIM)
    if (pos >= start) & (pos < end):
        one = tl.arange(0, 1)
        k = _norm_rope(row + HEADS * HEAD_DIM, kv_head + one, one < 1, offs_d, partner, sign, cos, sin,
                       k_weight_ptr, eps, NORM, HEAD_DIM)
        v = tl.load(row + (HEADS + KV_HEADS + kv_head + one[:, None]) * HEAD_DIM + offs_d[None, :])
        slot = tl.load(table + pos // BLOCK_SIZE).to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        store_kv_rows(k, v, slot, kv_head + one, one < 1, offs_d, k_cache_ptr, v_cache_ptr, inv_k_scale, inv_v_scale,
                      stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, BLOCK_SIZE, KV_FP8,
                      True)
        tl.debug_barrier()   # the stores above are seen by every thread of the program below
    return q


def qkv_rope_store(positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                   q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0, store_v: bool = True) -> torch.Tensor:
    """q [tokens, num_heads, head_dim] from the packed projection [tokens, (H + 2 KV) * D], its k
    and v stored in their cache slots: ops.qkv_rope and store_kvcache in one launch. store_v
    False: k only, the decode kernel storing v (paged_decode's new_v)."""
    num_tokens = qkv.shape[0]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [tokens, {(num_heads + 2 * num_kv_heads) * head_dim}] and "
                         f"contiguous in its last dim, got {tuple(qkv.shape)}")
    if head_dim & (head_dim - 1) or cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError("qkv_rope_store needs a power-of-two head dim and cos/sin tables "
                         "[positions, head_dim] of one layout")
    if k_cache.stride(-1) != 1:
        raise ValueError("qkv_rope_store needs a K cache contiguous in head_dim")
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    norm = q_weight is not None
    _qkv_rope_store_kernel[(num_tokens,)](
        qkv, positions, cos, sin, q_weight if norm else qkv, k_weight if norm else qkv, q,
        k_cache, v_cache, slot_mapping, eps, 1.0 / k_scale, 1.0 / v_scale,
        qkv.stride(0), positions.stride(0), cos.stride(0), q.stride(0), slot_mapping.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        v_cache.stride(3), HEADS=num_heads, KV_HEADS=num_kv_heads, HEADS_POW2=triton.next_power_of_2(num_heads),
        KV_HEADS_POW2=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim, NORM=norm,
        BLOCK_SIZE=v_cache.shape[1], KV_FP8=is_fp8(k_cache), STORE_V=store_v, num_warps=4 if num_heads * head_dim >= 1024 else 1, **pdl_launch(qkv.device),
    )
    return q


def check_rope(rope: NewTokenRope, q: torch.Tensor, kv_heads: int, query_start_loc: torch.Tensor | None) -> None:
    """The layouts the decode kernel's rope reads without checking."""
    _, heads, head_dim = q.shape
    if query_start_loc is not None:
        raise ValueError("a mixed step stores its K/V with qkv_rope_store: rope takes decode rows only")
    # a lone row's stride is whatever the view chose: the kernel never steps over it
    if q.stride(1) != head_dim or (q.shape[0] > 1 and q.stride(0) < (heads + 2 * kv_heads) * head_dim):
        raise ValueError(f"with rope, q must be the q columns of a packed projection [batch, "
                         f"{(heads + 2 * kv_heads) * head_dim}], got strides {q.stride()}")
    if rope.cos.stride(1) != 1 or rope.cos.stride() != rope.sin.stride() or rope.cos.shape[1] != head_dim:
        raise ValueError(f"rope needs cos/sin tables [positions, {head_dim}] of one layout")


def rope_kernel_args(rope: NewTokenRope | None, q: torch.Tensor, k_scale: float, v_scale: float) -> tuple:
    """The decode kernel's rope arguments in its order; placeholders, never read, without rope."""
    if rope is None:   # the inverse scales still serve new_v's store
        return (q, q, q, q, 0.0, 1.0 / k_scale, 1.0 / v_scale, 0)
    norm = rope.q_weight is not None
    return (rope.cos, rope.sin, rope.q_weight if norm else q, rope.k_weight if norm else q, rope.eps,
            1.0 / k_scale, 1.0 / v_scale, rope.cos.stride(0))
