"""The FP8 KV cache's number format: e4m3 (torch.float8_e4m3fn, Triton's float8e4nv) with a
per-layer scale, as vLLM's `--kv-cache-dtype fp8`.

A value x is stored as x / scale rounded to nearest-even and clamped to +-448; a read gives the
stored value times scale. scale is 1.0 unless the checkpoint carries k_scale / v_scale.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
# e4m3fn has no infinity: larger values are clamped here rather than left to a cast that
# saturates on some devices and turns to NaN on others
FP8_MAX = torch.finfo(FP8_DTYPE).max


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in e4m3, computed in float32 as the Triton store kernel does (same bits; NaN as 0)."""
    return (x.float() * (1.0 / scale)).nan_to_num(nan=0.0).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
