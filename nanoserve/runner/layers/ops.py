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


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, cos_cache: torch.Tensor, sin_cache: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and k, then rotary."""
    return rope(positions, rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos_cache, sin_cache)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class LayerOps:
    rms_norm: Callable
    add_rms_norm: Callable
    rope: Callable
    qk_norm_rope: Callable
    silu_mul: Callable


EAGER_OPS = LayerOps(rms_norm, add_rms_norm, rope, qk_norm_rope, silu_mul)


def compiled_ops() -> LayerOps:
    """The same functions fused by torch.compile (shapes dynamic in the token count)."""
    fuse = lambda fn: torch.compile(fn, dynamic=True, fullgraph=True)  # noqa: E731
    return LayerOps(*(fuse(fn) for fn in (rms_norm, add_rms_norm, rope, qk_norm_rope, silu_mul)))
