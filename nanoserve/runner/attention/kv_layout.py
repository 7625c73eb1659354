"""How a layer's V cache lies in memory. The kernels index every cache as [blocks, block_size,
kv_heads, head_dim] through its strides, so a layout is a view of the same storage.

An fp8 cache keeps V with each (kv head, dim)'s tokens contiguous within a block. The decode and
prefill kernels' value dot contracts over tokens: from rows of one token's dims, 8-bit values
reach the tensor cores one byte load at a time (256 shared-memory loads a thread for a 64-key
tile on one warp: 2,038 instructions a tile, compiled by Triton 3.6 for sm90), while tokens side by
side load in 16-byte rows (1,267 instructions a tile; `scripts/compile_for_gpu.py --byte-loads`
counts them, and a CPU test keeps it at none). Read from memory, a 128-key tile of such V
is one whole 128-byte line per dim, which is why the decode kernel takes 128-key tiles over it
(decode_tiles.decode_config; BENCHMARKS.md, "V along tokens"). K keeps a token's heads side
by side (its dot contracts over dims), and a 16-bit cache keeps V that way too: 16-bit tiles
transpose in the load itself.

Such a V tile is read whole, past a sequence's last token too (a masked load along contiguous
bytes goes byte by byte): its probabilities there are 0, so the cache must hold finite values
everywhere. It is allocated zeroed, and the store kernels write no NaN (attention/triton_fp8.py).
"""

from __future__ import annotations

import torch


def v_cache_view(storage: torch.Tensor, fp8: bool) -> torch.Tensor:
    """The V cache the kernels are given, over a contiguous [blocks, block_size, kv_heads, head_dim]
    storage: the storage itself, or for an fp8 cache the same bytes as [blocks, kv_heads,
    head_dim, block_size], seen in the common index order."""
    if not fp8:
        return storage
    blocks, block_size, kv_heads, head_dim = storage.shape
    return storage.view(blocks, kv_heads, head_dim, block_size).permute(0, 3, 1, 2)


def v_cache_copy(v: torch.Tensor) -> torch.Tensor:
    """A copy of an fp8 V cache, [blocks, block_size, kv_heads, head_dim] in any layout, laid out
    as the engine lays out its own (benchmarks and tests build theirs row by row)."""
    return v_cache_view(torch.empty_like(v, memory_format=torch.contiguous_format), fp8=True).copy_(v)


def tokens_contiguous(cache: torch.Tensor) -> bool:
    """Whether a cache view keeps a (kv head, dim)'s tokens side by side (and not its dims)."""
    return cache.stride(1) == 1 and cache.stride(3) != 1
