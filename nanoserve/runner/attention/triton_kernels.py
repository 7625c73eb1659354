"""Triton attention backend: KV store by slot mapping, paged decode (triton_decode) and paged
prefill (triton_prefill). Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (tests)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nanoserve.runner.attention.fp8 import is_fp8
from nanoserve.runner.attention.kv_layout import tokens_contiguous
from nanoserve.runner.attention.decode_splits import decode_split_count, engine_split_keys, split_span
from nanoserve.runner.attention.decode_tiles import decode_config
from nanoserve.runner.attention.triton_decode import paged_decode
from nanoserve.runner.attention.triton_fp8 import to_fp8
from nanoserve.runner.attention.triton_paged import store_kv_rows
from nanoserve.runner.attention.triton_prefill import paged_prefill
from nanoserve.runner.attention.triton_rope_store import qkv_rope_store
from nanoserve.runner.layers.rotary import NewTokenRope
from nanoserve.runner.batch import AttentionMetadata

__all__ = ["TritonBackend", "paged_decode", "paged_prefill", "qkv_rope_store", "store_kvcache", "to_fp8"]

# Fewer decode rows beside a prompt than this ride in the prefill launch: the split costs two more
# launches a layer, which an eager mixed step pays on the host. On an H200 (attention_kernels.py's
# mixed lines) the split already won at 32 decode rows of 1k keys: 77.7 against 96.8 us.
MIXED_MIN_DECODE_ROWS = 32
# a decode-only step of at most this many rows does its q/k norm, rotary and K/V store inside the
# decode kernel; larger ones launch them first, as a step with prompts does (NANOSERVE_DECODE_ROPE=0:
# always). On an H200 at 1k contexts (BENCHMARKS.md) it took batch 1 from 0.999 to 0.977 ms (bf16) and
# 0.925 to 0.854 (fp8), and lost at 16 (bf16 1.743 -> 1.782 ms) and 256 (8.61 -> 9.66; fp8 6.19 -> 6.34)
DECODE_ROPE_MAX_ROWS = 1 if os.environ.get("NANOSERVE_DECODE_ROPE", "1") == "1" else 0
# NANOSERVE_DECODE_STORES_V=1: a larger decode-only step over an fp8 cache whose V lies along tokens
# stores each row's new v from the decode kernel, a whole sector a dim (triton_paged.store_v_sectors),
# not as the store kernel's single bytes. Off: it took the fp8 step at batch 256 from 6.196 to 6.065 ms
# on an H200 but lost 0.7-1.7% of the fp8 workload on an H100 (BENCHMARKS.md)
DECODE_STORES_V = os.environ.get("NANOSERVE_DECODE_STORES_V", "0") == "1"


@triton.jit
def _store_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, inv_k_scale, inv_v_scale,
    stride_slot, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_ks, stride_kch, stride_vcb, stride_vs, stride_vch, stride_vcd,
    KV_HEADS: tl.constexpr, HEADS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token * stride_slot).to(tl.int64)
    if slot >= 0:   # -1 marks a padding token: it writes nothing
        offs_h = tl.arange(0, HEADS_POW2)
        offs_d = tl.arange(0, HEAD_DIM)
        mask = (offs_h < KV_HEADS)[:, None]
        src = token.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
        k = tl.load(k_ptr + src, mask=mask)
        src = token.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        v = tl.load(v_ptr + src, mask=mask)
        store_kv_rows(k, v, slot, offs_h, offs_h < KV_HEADS, offs_d, k_cache_ptr, v_cache_ptr, inv_k_scale,
                      inv_v_scale, stride_kcb, stride_ks, stride_kch, stride_vcb, stride_vs, stride_vch, stride_vcd,
                      BLOCK_SIZE, KV_FP8, True)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> None:
    """Write k/v [tokens, kv_heads, dim] to their cache slots (block * block_size + offset).
    An fp8 cache receives k / k_scale and v / v_scale (see attention/fp8.py)."""
    num_tokens, kv_heads, head_dim = k.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"store_kvcache needs a power-of-two head dim, got {head_dim}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("store_kvcache needs k, v and the K cache contiguous in their last dim")
    if is_fp8(k_cache) != is_fp8(v_cache):
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share a dtype")
    if num_tokens == 0:
        return
    _store_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        slot_mapping.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        v_cache.stride(3), KV_HEADS=kv_heads, HEADS_POW2=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim,
        BLOCK_SIZE=v_cache.shape[1], KV_FP8=is_fp8(k_cache), num_warps=4 if kv_heads * head_dim >= 1024 else 1,
    )


def eager_step_shapes(mixed: bool, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                      kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                      fp8_cache: bool) -> list[tuple[int, int]]:
    """(sequences, longest context) of eager steps that between them launch every decode-kernel
    variant such steps can need, unsplit and at each merge width: mixed (decode rows beside a
    prompt, which also brings the prefill kernel that leaves them out) or decode rows alone, with
    the q/k norm, rotary and store inside the decode kernel (up to DECODE_ROPE_MAX_ROWS rows) and
    without. Captured steps compile theirs at capture; these would otherwise compile (~1 s each)
    under the first such step served."""
    block_n = decode_config(device, fp8_cache, dtype, head_dim)["BLOCK_N"]   # keys per tile
    # a power of two falls in every range (a, 2a] of contexts that one merge width takes
    lengths = sorted({1 << i for i in range(max_model_len.bit_length())} | {max_model_len})
    if mixed:   # the decode rows and a prompt of at least two tokens, within the step's token budget
        seq_counts = range(MIXED_MIN_DECODE_ROWS + 1, min(max_num_seqs, max_num_batched_tokens - 1) + 1)
    else:
        seq_counts = range(1, min(max_num_seqs, max_num_batched_tokens) + 1)
    shapes: dict[tuple[int, bool], tuple[int, int]] = {}
    for seqs in seq_counts:
        rope = not mixed and seqs <= DECODE_ROPE_MAX_ROWS
        for length in lengths:
            # a mixed step's decode rows split evenly; alone they may take fixed-size splits
            keys = None if mixed else engine_split_keys(seqs, kv_heads, length, device, fp8_cache)
            splits = decode_split_count(seqs, kv_heads, length, device, split_span(keys, block_n), fp8_cache)
            shapes.setdefault((triton.next_power_of_2(splits), rope), (seqs, length))   # the merge's width
    return list(shapes.values())


class TritonBackend:
    """Attention through our own Triton kernels. The decode path reads no host lists and
    syncs nothing, so it can be captured in a CUDA graph (see triton_decode).

    The model hands it the packed q/k/v projection (fuses_kv_store: `attend_qkv`), whose q/k
    norm, rotary and K/V store then take one launch before attention, or none in a decode-only
    step, where the decode kernel does them; `forward` is the store and `attend` in two launches."""

    name = "triton"
    supports_cuda_graphs = True
    fuses_kv_store = True
    eager_step_shapes = staticmethod(eager_step_shapes)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0, window: int | None = None) -> torch.Tensor:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return self.attend(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window)

    def attend_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int, rope: NewTokenRope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                   v_scale: float = 1.0, window: int | None = None) -> torch.Tensor:
        """Attention of the packed projection [tokens, (num_heads + 2 num_kv_heads) * head_dim]:
        q/k normed (rope's weights) and rotated, k/v stored at meta.slot_mapping, then attended."""
        if meta.decode_only and qkv.shape[0] <= DECODE_ROPE_MAX_ROWS:
            # a decode row's position is its last key's (seq_len - 1) and its slot that key's
            q = qkv[:, :num_heads * head_dim].unflatten(1, (num_heads, head_dim))
            return self._decode(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, rope)
        decode_stores_v = meta.decode_only and DECODE_STORES_V and is_fp8(v_cache) and tokens_contiguous(v_cache)
        q = qkv_rope_store(positions, qkv, num_heads, num_kv_heads, head_dim, rope.cos, rope.sin,
                           rope.q_weight, rope.k_weight, rope.eps, k_cache, v_cache, meta.slot_mapping,
                           k_scale, v_scale, store_v=not decode_stores_v)
        if decode_stores_v:
            new_v = qkv[:, (num_heads + num_kv_heads) * head_dim:].unflatten(1, (num_kv_heads, head_dim))
            return self._decode(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, new_v=new_v)
        return self.attend(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
               v_scale: float = 1.0, window: int | None = None) -> torch.Tensor:
        """Attention over keys already in the cache (the new tokens' included)."""
        if meta.decode_only:
            return self._decode(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window)
        # a mixed step: its decode rows through the decode kernel, which pads a row's query group
        # to 16, where the prefill kernel pads it to a 128-row tile (and its softmax with it)
        # (a captured step says at capture, and its staged prefill tiles leave decode rows out)
        mixed = (meta.split_decode_rows if meta.split_decode_rows is not None
                 else meta.num_decode_rows >= MIXED_MIN_DECODE_ROWS)
        out = paged_prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                            meta.block_tables, scale, meta.max_query_len,
                            num_query_tokens=meta.num_query_tokens,
                            k_scale=k_scale, v_scale=v_scale, skip_decode_rows=mixed, tiles=meta.prefill_tiles,
                            window=window, splits=meta.prefill_splits)
        if mixed:
            paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale, meta.max_seq_len,
                         k_scale=k_scale, v_scale=v_scale, query_start_loc=meta.query_start_loc, out=out,
                         window=window)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, k_scale: float, v_scale: float, window: int | None,
                rope: NewTokenRope | None = None, new_v: torch.Tensor | None = None) -> torch.Tensor:
        return paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale, meta.max_seq_len,
                            k_scale=k_scale, v_scale=v_scale, seq_order=meta.decode_order, rope=rope, new_v=new_v,
                            window=window,
                            split_keys=engine_split_keys(q.shape[0], k_cache.shape[2], meta.max_seq_len, q.device,
                                                         is_fp8(k_cache)))
