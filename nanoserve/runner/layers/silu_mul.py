"""silu(gate) * up over a gated MLP's [gate | up] rows, in Triton: the SiLU-mul of the GPU path.

torch.compile's kernel for the same expression read and wrote at about a third of the copy rate
at prefill sizes on an H200 (4,096 tokens x 3,072: 61 us where 75 MB allow ~18). This one gives
each program a contiguous stretch of one row: two vector loads, float32 math, one rounding to
the input's dtype (as the compiled kernel and the gated GEMM's prologue round), one store.

CUDA-graph safe: the grid depends on the input's shape only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.runner.pdl import pdl_launch, pdl_prologue

BLOCK = 1024   # columns a program covers: 8 bf16 values per thread and load at 4 warps


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_out, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * width] as [gate | up] -> silu(gate) * up [..., width], in x's dtype."""
    if x.shape[-1] % 2:
        raise ValueError(f"SiLU-mul needs an even last dim ([gate | up]), got {x.shape[-1]}")
    width = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], width, dtype=x.dtype, device=x.device)
    if rows.shape[0] and width:
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(width, BLOCK))](
            rows, out, width, rows.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4, **pdl_launch(x.device))
    return out.view(*x.shape[:-1], width)
