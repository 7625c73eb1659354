"""RMSNorm, with the residual add in front of it, in Triton: the norms of the GPU path.

torch.compile fuses the same expression into one kernel too, but torch launches it without PDL
(pdl.py): the GEMM after a norm then cannot be scheduled until the norm has ended, and the norm
cannot start until the kernel ahead has. This kernel takes part in the chain: it reads its gamma
before the wait and everything else after it.

One program a row (a hidden size of a few thousand fits one block). It rounds where the eager
ops.add_rms_norm rounds: x + residual to x's dtype (the new residual, the same bits), the
normalized row to x's dtype, and gamma times that to x's dtype. The mean square sums in another
order than torch's reduction, so an output may differ from the eager one by a rounding.

CUDA-graph safe: the grid depends on the input's shape only.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nanoserve.runner.pdl import pdl_launch, pdl_prologue

MAX_WIDTH = 16384   # wider rows stay on the compiled kernel: one block a row would spill
ENABLED = os.environ.get("NANOSERVE_TRITON_NORM", "1") != "0"   # 0: the compiled kernel (A/B runs)


@triton.jit
def load_sum(x_ptrs, res_ptrs, mask, HAS_RES: tl.constexpr):
    """x (+ residual) in float32, rounded to x's dtype as a separate add stores it."""
    h = tl.load(x_ptrs, mask=mask, other=0.0)
    if HAS_RES:
        h = (h.to(tl.float32) + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)).to(h.dtype)
    return h.to(tl.float32)


@triton.jit
def rms_scale(sum_of_squares, width, eps):
    """1 / sqrt(mean(h^2) + eps), from the row's sum of squares."""
    return 1.0 / tl.sqrt(sum_of_squares / width + eps)


@triton.jit
def normed(h, inv_rms, gamma, dtype: tl.constexpr):
    """gamma * (h * inv_rms), float32 in, rounded to dtype after each step as the eager RMSNorm
    rounds (the skinny GEMM's folded norm computes its input with this too)."""
    return (gamma * (h * inv_rms).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, new_res_ptr, gamma_ptr, out_ptr, width, stride_x, stride_res, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    gamma = tl.load(gamma_ptr + cols, mask=mask, other=0.0).to(tl.float32)   # no kernel of the step writes it
    pdl_prologue(USE_PDL)
    h = load_sum(x_ptr + row * stride_x + cols, res_ptr + row * stride_res + cols, mask, HAS_RES)
    if HAS_RES:
        tl.store(new_res_ptr + row * width + cols, h.to(new_res_ptr.dtype.element_ty), mask=mask)
    scale = rms_scale(tl.sum(h * h, 0), width, eps)
    tl.store(out_ptr + row * width + cols, normed(h, scale, gamma, out_ptr.dtype.element_ty), mask=mask)


def takes(x: torch.Tensor, gamma: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether the kernel serves this norm: rows of a width it holds, in gamma's dtype, and a
    residual (if any) of x's shape and dtype."""
    return (ENABLED and x.is_cuda and x.dtype == gamma.dtype and gamma.dim() == 1
            and x.shape[-1] == gamma.shape[0] <= MAX_WIDTH
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, gamma: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * gamma, x + residual) as ops.add_rms_norm gives them; without a
    residual (rms_norm(x) * gamma, x). Rows of x: its last dim."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], width, dtype=x.dtype, device=x.device)
    if residual is None:
        res, new_res = rows, rows
    else:
        res = residual.reshape(-1, width)
        if res.stride(-1) != 1:
            res = res.contiguous()
        new_res = torch.empty_like(out)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res, new_res, gamma, out, width, rows.stride(0), res.stride(0), eps,
            HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(width),
            num_warps=4 if width <= 2048 else 8, **pdl_launch(x.device))
    summed = x if residual is None else new_res.view(x.shape)
    return out.view(x.shape), summed


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    return add_rms_norm(x, None, gamma, eps)[0]
