"""Attention through the flash-attn package: varlen prefill and paged decode over our KV cache.

flash-attn reads paged KV only in pages of 256 tokens (or a multiple), so the engine's block
size must be one. The KV store uses our Triton kernel (flash-attn has no standalone one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.runner.batch import AttentionMetadata

FLASH_BLOCK_MULTIPLE = 256


class FlashAttnBackend:
    """flash_attn_varlen_func for prefill (keys read through the block table, so prefix hits
    and chunked prefill work), flash_attn_with_kvcache for decode (CUDA-graph safe)."""

    name = "flash_attn"
    supports_cuda_graphs = True
    fuses_kv_store = False

    def __init__(self, block_size: int) -> None:
        if block_size % FLASH_BLOCK_MULTIPLE:
            raise ValueError(f"the flash_attn backend needs a block size that is a multiple of "
                             f"{FLASH_BLOCK_MULTIPLE} for paged KV, got {block_size}; use "
                             f"--block-size 256 or the triton backend")
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # lazy: optional

        from nanoserve.runner.attention.triton_kernels import store_kvcache
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self._store = store_kvcache
        self.block_size = block_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0, window: int | None = None) -> torch.Tensor:
        if k_cache.shape[1] != self.block_size:
            raise ValueError(f"cache block size {k_cache.shape[1]} != backend's {self.block_size}")
        self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        # flash-attn's window is inclusive, keys [p - left, p + right]: p - window < k <= p is (window - 1, 0),
        # as transformers passes it (modeling_flash_attention_utils.py)
        window_size = (window - 1, 0) if window is not None else (-1, -1)
        if meta.decode_only:
            # flash needs contiguous seq lens: the runner's are (no copy then); views get one
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                     cache_seqlens=meta.seq_lens.contiguous(),
                                     block_table=meta.block_tables,
                                     softmax_scale=scale, causal=True, window_size=window_size)
            return out.squeeze(1)
        cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens, 0, dtype=torch.int32), (1, 0))
        # causal with fewer queries than keys aligns the queries to the end, as our positions do
        return self._varlen(q, k_cache, v_cache,
                            cu_seqlens_q=meta.query_start_loc.contiguous(),
                            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=meta.max_query_len,
                            max_seqlen_k=meta.max_seq_len, softmax_scale=scale, causal=True,
                            window_size=window_size, block_table=meta.block_tables)
