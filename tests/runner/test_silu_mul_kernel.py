"""The Triton SiLU-mul against torch, under the Triton interpreter (tests/gpu has the device
version): widths that are and are not multiples of the kernel's block, one row and many, leading
batch dims, a strided input, and each dtype.

Tolerance: the kernel computes in float32 and rounds once, so float32 agrees within 1e-6
relative and fp16 within one rounding of the float32 result (2^-11 relative). bf16 gets one ulp
(2^-7): the interpreter narrows float32 to bf16 by truncation, where a GPU rounds to nearest.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available():
    pytest.skip("the GPU version of this check lives in tests/gpu", allow_module_level=True)

from nanoserve.runner.layers.silu_mul import BLOCK, silu_mul  # noqa: E402

TOL = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-11}


def reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2 * 48), (5, 2 * BLOCK), (3, 2 * (BLOCK + 37)), (2, 3, 2 * 200)])
def test_silu_mul_matches_torch(dtype, shape) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 4).to(dtype)
    got = silu_mul(x)
    want = reference(x)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype])


def test_silu_mul_reads_a_strided_input_and_handles_no_rows() -> None:
    wide = torch.randn(4, 2 * 64 + 10)
    x = wide[:, :2 * 64]   # rows 138 apart: not contiguous as a whole
    torch.testing.assert_close(silu_mul(x), reference(x), rtol=1e-6, atol=1e-6)
    assert silu_mul(torch.empty(0, 2 * 64)).shape == (0, 64)
    with pytest.raises(ValueError, match="even last dim"):
        silu_mul(torch.randn(2, 7))
