"""Reference attention: plain torch, one sequence at a time. The oracle for every kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.runner.attention.fp8 import is_fp8, quantize_fp8
from nanoserve.runner.batch import AttentionMetadata


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write each token's K/V to its cache slot; slot -1 (padding) writes nothing. An fp8 cache
    receives k / k_scale and v / v_scale."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k, v = k[keep], v[keep]
    if is_fp8(k_cache):
        k, v = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    block_size = k_cache.shape[1]
    for cache, x in ((k_cache, k), (v_cache, v)):   # indexed by (block, offset): any layout (kv_layout.py)
        cache[slots // block_size, slots % block_size] = x


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence, [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-length // block_size)].long()
    return cache[blocks].flatten(0, 1)[:length]


def read_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, dtype: torch.dtype,
            fp8_scale: float) -> torch.Tensor:
    """gather_kv in `dtype`; an fp8 cache's values times their scale."""
    kv = gather_kv(cache, block_table, length)
    return kv.to(dtype) * fp8_scale if is_fp8(cache) else kv


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                    v_scale: float = 1.0, window: int | None = None) -> torch.Tensor:
    """Causal attention of packed queries [tokens, heads, dim] over keys read from the cache; with a
    sliding window, the query at position p attends keys k with p - window < k <= p, as
    transformers' sliding_window_overlay (masking_utils.py: kv_idx > q_idx - sliding_window)."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]
    hi = 0
    for i, (q_len, kv_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        lo, hi = hi, hi + q_len
        if kv_len == 0:  # padding row: reads nothing
            continue
        keys = read_kv(k_cache, meta.block_tables[i], kv_len, q.dtype, k_scale)
        values = read_kv(v_cache, meta.block_tables[i], kv_len, q.dtype, v_scale)
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        # query j sits at position kv_len - q_len + j and sees keys up to and including it
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        mask = k_pos <= q_pos[:, None]
        if window is not None:
            mask &= k_pos > q_pos[:, None] - window
        o = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1), keys.transpose(0, 1),
                                           values.transpose(0, 1), attn_mask=mask, scale=scale)
        out[lo:hi] = o.transpose(0, 1)
    return out


class TorchBackend:
    """Attention backend of plain torch ops: CPU runs and the reference in tests."""

    name = "torch"
    supports_cuda_graphs = False
    fuses_kv_store = False   # the model runs ops.qkv_rope, then forward stores and attends

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0, window: int | None = None) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return paged_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window)
