"""The skinny Triton GEMM on the GPU at the linear shapes of Qwen3-0.6B and Qwen3-8B, bf16, against
F.linear in float32; under CUDA graph capture and replay with new inputs; and the startup choice.
Also the startup choice of cuBLASLt past the skinny rows, and a layer replaying it from a graph.

Tolerance: the float32 reference of the same bf16 inputs, within two bf16 roundings of the output
(2^-7 relative) plus 1e-2 absolute on outputs of unit spread; cuBLAS in bf16 is held to the same.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from nanoserve.runner.layers.blas_choice import choose_blas_lt, enable_blas_lt
from nanoserve.runner.layers.linear import RowParallelLinear, building_graphs
from nanoserve.runner.layers.ops import add_rms_norm
from nanoserve.runner.layers.skinny_choice import choose_gated, choose_normed, choose_skinny, row_buckets
from nanoserve.runner.layers.small_gemm import skinny_config, skinny_linear, skinny_linear_normed

pytestmark = pytest.mark.gpu

SHAPES = {   # name: (N, K) of weight [N, K]
    "0.6b-qkv": (4096, 1024), "0.6b-o": (1024, 2048), "0.6b-gate_up": (6144, 1024),
    "0.6b-down": (1024, 3072), "8b-qkv": (6144, 4096), "8b-o": (4096, 4096),
    "8b-gate_up": (24576, 4096), "8b-down": (4096, 12288),
}
RTOL, ATOL = 2**-7, 1e-2


def inputs(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()   # outputs ~ N(0, 1)
    return x, w


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 13, 16, 32, 64, 100, 256])
def test_real_shapes_match_float32(name, rows):
    n, k = SHAPES[name]
    x, w = inputs(rows, n, k, seed=rows)
    bias = torch.randn(n, device="cuda").bfloat16() if rows == 3 else None
    want = F.linear(x.float(), w.float(), bias.float() if bias is not None else None)
    got = skinny_linear(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(F.linear(x, w, bias).float(), want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["0.6b-qkv", "0.6b-o", "8b-down"])
@pytest.mark.parametrize("rows", [1, 2, 4, 16, 200])
def test_replays_of_a_captured_graph_see_new_inputs(name, rows):
    n, k = SHAPES[name]
    x, w = inputs(rows, n, k, seed=100 + rows)
    assert_replays_see_new_inputs(lambda: skinny_linear(x, w), x, w)


def assert_replays_see_new_inputs(product: Callable[[], torch.Tensor], x: torch.Tensor, w: torch.Tensor) -> None:
    """product() (x W^T), captured in a CUDA graph after a warm-up outside it, gives the float32
    product of fresh inputs copied into x at each replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # compile and warm up outside the capture
        product()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = product()
    for seed in (1, 2):
        fresh, _ = inputs(x.shape[0], w.shape[0], w.shape[1], seed=seed)
        x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), F.linear(fresh.float(), w.float()), rtol=RTOL, atol=ATOL)


def test_split_k_is_exercised_by_the_real_shapes():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert any(skinny_config(rows, n, k, sms).split_k > 1
               for rows in (1, 4, 16) for n, k in SHAPES.values())


def test_the_startup_choice_names_only_shapes_and_buckets_it_timed():
    shapes = [SHAPES["0.6b-o"], SHAPES["0.6b-qkv"]]
    wins = choose_skinny(shapes, 8, torch.device("cuda"), torch.bfloat16)
    assert all((n, k) in shapes and rows in row_buckets(8) for n, k, rows in wins)


def test_a_skinny_kernel_that_fails_on_the_device_leaves_cublas_in_place(monkeypatch):
    """The startup choice must not stop the server over a kernel that cannot build or launch."""
    from nanoserve.runner.layers import small_gemm

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(small_gemm, "skinny_linear", broken)
    assert choose_skinny([SHAPES["0.6b-o"]], 4, torch.device("cuda"), torch.bfloat16) == set()


@pytest.mark.parametrize("name", ["0.6b-down", "8b-down"])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 32, 100])
def test_a_gated_input_matches_silu_mul_then_the_product(name, rows):
    """silu(gate) * up computed as the kernel loads, against the unfused path in float32 (after
    SiLU-mul's own bf16 rounding, which the kernel reproduces)."""
    n, k = SHAPES[name]
    gate_up, w = inputs(rows, n, 2 * k, seed=200 + rows)
    w = w[:, :k].contiguous() * 2**0.5   # outputs ~ N(0, 1) over k inputs
    gate, up = gate_up.float().chunk(2, dim=-1)
    x = (F.silu(gate) * up).bfloat16()
    got = skinny_linear(gate_up, w, gated=True)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), rtol=RTOL, atol=ATOL)


def test_the_gated_choice_stays_within_the_plain_wins():
    shape = SHAPES["0.6b-down"]
    wins = choose_skinny([shape], 8, torch.device("cuda"), torch.bfloat16)
    gated = choose_gated(wins, [shape], torch.device("cuda"), torch.bfloat16)
    assert gated <= wins


@pytest.mark.parametrize("name", ["0.6b-qkv", "0.6b-gate_up", "8b-qkv", "8b-gate_up"])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_normed_input_matches_add_rms_norm_then_the_product(name, rows):
    """The residual add and RMSNorm done as the kernel loads: the new residual bit for bit, the
    product against the unfused path's normed input in float32."""
    n, k = SHAPES[name]
    x, w = inputs(rows, n, k, seed=300 + rows)
    residual = torch.randn(rows, k, device="cuda").bfloat16()
    gamma = (torch.rand(k, device="cuda") + 0.5).bfloat16()
    normed, summed = add_rms_norm(x, residual, gamma, 1e-6)
    got, new_residual = skinny_linear_normed(x, residual, gamma, 1e-6, w)
    assert torch.equal(new_residual, summed)
    torch.testing.assert_close(got.float(), F.linear(normed.float(), w.float()), rtol=RTOL, atol=ATOL)
    got, same = skinny_linear_normed(x, None, gamma, 1e-6, w)   # a first layer: no residual yet
    assert same is x
    torch.testing.assert_close(got.float(), F.linear(add_rms_norm(x, torch.zeros_like(x), gamma, 1e-6)[0].float(),
                                                     w.float()), rtol=RTOL, atol=ATOL)


def test_the_normed_choice_names_only_the_shapes_and_buckets_it_timed():
    shapes = [SHAPES["0.6b-qkv"], SHAPES["0.6b-gate_up"]]
    wins = choose_skinny(shapes, 2, torch.device("cuda"), torch.bfloat16)
    normed = choose_normed(wins, shapes, torch.device("cuda"), torch.bfloat16)
    assert all((n, k) in shapes and rows in (1, 2) for n, k, rows in normed)


def test_the_cublaslt_choice_names_only_shapes_and_rows_it_timed():
    shapes = [SHAPES["8b-down"], SHAPES["0.6b-o"]]
    before = torch.backends.cuda.preferred_blas_library()
    wins = choose_blas_lt(shapes, [48, 192], torch.device("cuda"), torch.bfloat16)
    assert all((n, k) in shapes and rows in (48, 192) for n, k, rows in wins)
    assert torch.backends.cuda.preferred_blas_library() == before


@pytest.mark.parametrize("name", ["8b-down", "0.6b-qkv"])
def test_a_layer_on_cublaslt_replays_a_captured_graph_with_new_inputs(name):
    n, k = SHAPES[name]
    rows = 192
    x, w = inputs(rows, n, k, seed=7)
    layer = RowParallelLinear(k, n).cuda().bfloat16()
    layer.weight.data.copy_(w)
    assert enable_blas_lt(layer, {(n, k, rows)}) == 1
    with building_graphs():
        assert_replays_see_new_inputs(lambda: layer(x), x, w)
