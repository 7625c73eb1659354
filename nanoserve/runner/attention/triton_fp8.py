"""Quantization to the fp8 KV cache's e4m3 inside Triton kernels (the store kernels)."""

from __future__ import annotations

import os

import triton
import triton.language as tl

from nanoserve.runner.attention.fp8 import FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)
# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) casts to fp8 wrongly; on a GPU the
# hardware's own cast (round to nearest even, saturating) is what torch's cast does too
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def to_fp8(x, inv_scale, dtype: tl.constexpr):
    """x * inv_scale in e4m3 (dtype), rounded to nearest-even and clamped to +-FP8_MAX; NaN as 0.

    On a GPU the cast itself rounds. Under Triton's interpreter (3.9), which rounds ties away and
    drops the carry into the exponent (7.9 -> 4.0), the value is put on the e4m3 grid in float32
    first, so that the cast rounds nothing; on the GPU that emulation gave other bits than
    torch's cast for some values, so it serves the interpreter only."""
    x = x.to(tl.float32) * inv_scale
    # no NaN goes in: a cache V tile is read whole, past a sequence's end (kv_layout.py)
    x = tl.where(x == x, x, 0.0)
    x = tl.minimum(tl.maximum(x, -_FP8_MAX), _FP8_MAX)
    if _INTERPRETED:
        # normal e4m3 keeps 3 of float32's 23 mantissa bits: round the other 20 away, ties to even
        bits = x.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        # below 2**-6 (subnormal e4m3) the grid is 2**-9: adding 2**23 rounds |x| * 2**9 to an integer
        tiny = (tl.abs(x) * 512.0 + 8388608.0 - 8388608.0) * (1.0 / 512.0)
        tiny = tl.where(bits < 0, -tiny, tiny)   # the sign bit, so that -0.0 stays -0.0 as in torch
        x = tl.where(tl.abs(x) < 0.015625, tiny, normal)
    return x.to(dtype)
