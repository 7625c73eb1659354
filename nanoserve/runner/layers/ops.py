"""The small elementwise pieces of a layer, as plain functions.

Eagerly each is several kernels; on the GPU `torch.compile` fuses each into one, which matters
inside a decode step where hundreds of tiny kernels would otherwise dominate. `LayerOps`
bundles one variant so that a model picks it once, at construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return rms_norm(x, weight, eps), x


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
         sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, dim] and k [tokens, kv_heads, dim] rotated by their positions (NeoX layout)."""
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.reshape(-1, num_heads, head_dim), k.reshape(-1, num_kv_heads, head_dim),
            v.reshape(-1, num_kv_heads, head_dim))


def qkv_rope(positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
             cos_cache: torch.Tensor, sin_cache: torch.Tensor, q_weight: torch.Tensor | None = None,
             k_weight: torch.Tensor | None = None, eps: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the packed projection [tokens, (H + 2 KV) * D] into q, k, v; Qwen3's per-head RMSNorm
    of q and k when their weights are given; rotary on q and k.

    Taking the contiguous packed tensor, not strided views of it, keeps torch.compile from
    specializing on strides that happen to equal a token count."""
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    q, k = rope(positions, q, k, cos_cache, sin_cache)
    return q, k, v


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class LayerOps:
    rms_norm: Callable
    add_rms_norm: Callable
    qkv_rope: Callable
    silu_mul: Callable


EAGER_OPS = LayerOps(rms_norm, add_rms_norm, qkv_rope, silu_mul)


def compiled_ops() -> LayerOps:
    """The GPU path: the same functions fused by torch.compile, but SiLU-mul in a Triton kernel
    of its own (layers/silu_mul.py): the compiled one ran at about a third of the copy rate at
    prefill sizes; and the norms in one (layers/rms_norm_kernel.py) that takes part in PDL."""
    from nanoserve.runner.layers import rms_norm_kernel as norm_kernel
    from nanoserve.runner.layers.silu_mul import silu_mul as triton_silu_mul

    # each model shape compiles its own variants; a process that loads several models (tests,
    # benchmarks) would otherwise run out of dynamo's default budget of 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # default (automatic) dynamism: the token count turns dynamic after its first change, while the
    # model's own ints (heads, head_dim) stay constants that no token count can be confused with
    fuse = lambda fn: torch.compile(fn, fullgraph=True)  # noqa: E731
    fused_rms_norm, fused_add_rms_norm, fused_qkv_rope = (fuse(fn) for fn in (rms_norm, add_rms_norm, qkv_rope))

    def gpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if norm_kernel.takes(x, weight):
            return norm_kernel.rms_norm(x, weight, eps)
        return fused_rms_norm(x, weight, eps)

    def gpu_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        if norm_kernel.takes(x, weight, residual):
            return norm_kernel.add_rms_norm(x, residual, weight, eps)
        return fused_add_rms_norm(x, residual, weight, eps)

    return LayerOps(gpu_rms_norm, gpu_add_rms_norm, fused_qkv_rope, triton_silu_mul)
