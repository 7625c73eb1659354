"""The Triton SiLU-mul on the GPU against torch's float32 result, at decode and prefill sizes of
the 0.6B and 8B widths, and replayed from a CUDA graph, as decode runs it.

Tolerance: one ulp of the output dtype (2^-7 relative for bf16, 2^-10 for fp16): one rounding of
a float32 result whose exp and division the GPU may approximate (float32: 1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoserve.runner.layers.silu_mul import silu_mul

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows, width", [(1, 3072), (7, 12288), (4096, 3072), (3, 1000)])
def test_silu_mul_matches_torch_on_the_gpu(dtype, rows, width) -> None:
    x = (torch.randn(rows, 2 * width, device="cuda") * 4).to(dtype)
    torch.testing.assert_close(silu_mul(x).float(), reference(x), rtol=TOL[dtype], atol=TOL[dtype])


def test_silu_mul_replays_from_a_cuda_graph() -> None:
    x = torch.randn(16, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    silu_mul(x)   # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_mul(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), reference(x), rtol=2**-7, atol=2**-7)
