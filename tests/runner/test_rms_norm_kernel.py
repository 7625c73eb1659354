"""The Triton add + RMSNorm against the eager ops.add_rms_norm, under the Triton interpreter
(tests/gpu has the device version): hidden sizes that are and are not powers of two, one row and
many, leading batch dims, strided inputs, with and without a residual, and each dtype.

Tolerance: float32 within 1e-5 relative (the mean square sums in another order). fp16 within two
roundings of the output (2^-10 relative), bf16 within two truncations (2^-6): the interpreter
narrows float32 to 16 bits by truncation, where a GPU rounds to nearest, and the normalized row
and the product are each narrowed, as the eager op rounds them. The new residual is one addition rounded once: equal in float32, within one
truncation in 16-bit types.
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("the GPU version of this check lives in tests/gpu", allow_module_level=True)

from nanoserve.runner.layers import ops, rms_norm_kernel  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-10}


def inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x, residual = ((torch.randn(shape, generator=gen) * 3).to(dtype) for _ in range(2))
    gamma = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    return x, residual, gamma


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 1024), (3, 200), (2, 3, 96)])
def test_add_rms_norm_matches_the_eager_op(dtype, shape) -> None:
    x, residual, gamma = inputs(shape, dtype, sum(shape))
    got, got_sum = rms_norm_kernel.add_rms_norm(x, residual, gamma, 1e-6)
    want, want_sum = ops.add_rms_norm(x, residual, gamma, 1e-6)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape and got_sum.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])
    if dtype == torch.float32:
        assert torch.equal(got_sum, want_sum)
    else:
        torch.testing.assert_close(got_sum.float(), want_sum.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_without_a_residual_matches_and_hands_x_back(dtype) -> None:
    x, _, gamma = inputs((5, 320), dtype, 3)
    got, summed = rms_norm_kernel.add_rms_norm(x, None, gamma, 1e-5)
    assert summed is x
    torch.testing.assert_close(got.float(), ops.rms_norm(x, gamma, 1e-5).float(), rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(rms_norm_kernel.rms_norm(x, gamma, 1e-5), got, rtol=0, atol=0)


def test_strided_rows_and_no_rows() -> None:
    wide, residual, gamma = inputs((4, 160), torch.float32, 9)
    x = wide[:, :128]   # rows 160 apart
    got, got_sum = rms_norm_kernel.add_rms_norm(x, residual[:, 16:144], gamma[:128], 1e-6)
    want, want_sum = ops.add_rms_norm(x, residual[:, 16:144], gamma[:128], 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_sum, want_sum)
    empty = torch.empty(0, 128)
    out, summed = rms_norm_kernel.add_rms_norm(empty, empty, gamma[:128], 1e-6)
    assert out.shape == (0, 128) and summed.shape == (0, 128)


def test_the_gpu_path_takes_only_what_the_kernel_holds() -> None:
    x = torch.randn(2, 64)
    assert not rms_norm_kernel.takes(x, torch.ones(64))   # not on a GPU: the compiled op runs
