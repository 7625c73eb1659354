"""The skinny Triton GEMM against torch in float32, under the Triton interpreter: every row count
1..32, widths and depths that are not multiples of the tiles, split-K on and off, both the
CUDA-core (1-2 rows) and tl.dot paths, bias or none; and the linear layers, whose CPU path stays
F.linear.

Tolerance: float32 within 1e-5 relative (only the order of the float32 sums differs); bf16 and
fp16 within two roundings of the output (2^-7 relative for bf16, 2^-10 for fp16) of the float32
result of the same rounded inputs: the output is rounded once, the rest is summation order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoserve.runner.layers.linear import PackedLinear, RowParallelLinear, building_graphs, row_bucket
from nanoserve.runner.layers.skinny_choice import agrees_with_cublas, describe, enable_skinny_gemm, row_buckets

if torch.cuda.is_available():
    pytest.skip("the GPU version of this check lives in tests/gpu", allow_module_level=True)

import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from nanoserve.runner.layers import small_gemm, split_k_sum  # noqa: E402
from nanoserve.runner.layers.small_gemm import SkinnyConfig, skinny_config, skinny_linear  # noqa: E402

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 1e-3), torch.float16: (2**-10, 1e-3)}


@pytest.fixture(autouse=True)
def bf16_dot_in_interpreter(monkeypatch):
    """Triton's interpreter multiplies bf16 tl.dot operands as their uint16 bit patterns (its
    create_dot widens fp8 only); widen bf16 to float32 first, which is exact, as a GPU's bf16
    products are. The CUDA-core path and everything around the dot run unpatched."""
    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, *args):
        widen = lambda t: self.cast_impl(t, tl.float32) if t.dtype.scalar == tl.bfloat16 else t  # noqa: E731
        return original(self, widen(a), widen(b), *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def check(rows: int, n: int, k: int, dtype: torch.dtype, config: SkinnyConfig | None = None,
          bias: bool = False, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed * 1000 + rows * 7 + n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    want = x.float() @ w.float().T + (b.float() if bias else 0)
    got = skinny_linear(x, w, b, config)
    assert got.shape == (rows, n) and got.dtype == dtype
    rtol, atol = TOL[dtype]
    # sums of k products of unit normals: scale the absolute part by their spread
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol * k ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", list(range(1, 18)) + [24, 32])
def test_every_row_count_matches_torch_with_the_default_tiles(dtype, rows) -> None:
    for n, k in ((48, 160), (36, 300)):   # 300: a ragged last K block; 36: a ragged N block
        check(rows, n, k, dtype, seed=1)


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_float16_matches_torch(rows) -> None:
    check(rows, 36, 300, torch.float16, bias=True, seed=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [
    SkinnyConfig(1, 4, 64, 1), SkinnyConfig(1, 8, 128, 3), SkinnyConfig(1, 16, 32, 8),
    SkinnyConfig(2, 4, 64, 1), SkinnyConfig(2, 8, 64, 4),
    SkinnyConfig(16, 16, 32, 1), SkinnyConfig(16, 32, 64, 3), SkinnyConfig(32, 64, 16, 16),
], ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}")
# K 256 takes whole blocks of every block_k here, 200 none (EVEN_K is the kernel's only shape
# branch); N is masked and clamped either way, so 32 only keeps the programs few
@pytest.mark.parametrize("n,k", [(32, 256), (37, 200)])
def test_split_k_and_tile_shapes_match_torch(dtype, config, n, k) -> None:
    for rows in sorted({1, config.block_m // 2 or 1, config.block_m}):
        check(rows, n, k, dtype, config, bias=rows % 2 == 1, seed=2)


@pytest.mark.parametrize("config", [SkinnyConfig(1, 16, 32, 8), SkinnyConfig(16, 16, 16, 16)])
def test_splits_past_the_end_of_k_add_nothing(config) -> None:
    """72 columns over 8 or 16 splits of whole blocks: the last splits get no K at all."""
    check(config.block_m, 20, 72, torch.float32, config, bias=True, seed=4)


@pytest.mark.parametrize("config,rows", [(SkinnyConfig(1, 8, 32, 4), 1), (SkinnyConfig(2, 4, 16, 8), 2),
                                         (SkinnyConfig(16, 16, 32, 4), 9), (SkinnyConfig(16, 8, 16, 2), 40)],
                         ids=["fma-1", "fma-2", "dot", "dot-row-tiles"])
def test_the_last_split_sums_as_the_sum_kernel_does_and_leaves_the_counts_at_zero(monkeypatch, config, rows) -> None:
    """The partials summed by the last split of each tile: the sum kernel's bits (the same order),
    call after call over the same counters, bias or none, several row tiles; the counts end at 0.
    The partials start as NaN: a sum that ran before every split had written its own would show."""
    monkeypatch.setattr(split_k_sum, "split_partials", lambda *shape_and_device: torch.full(
        shape_and_device[:3], float("nan"), device=shape_and_device[3]))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 72, generator=gen).to(torch.bfloat16)
    w, b = torch.randn(20, 72, generator=gen).to(torch.bfloat16), torch.randn(20, generator=gen).to(torch.bfloat16)
    counts = split_k_sum.tile_counts(x.device, 1, 1)
    for bias in (None, b):
        monkeypatch.setattr(split_k_sum, "SUM_IN_LAST_SPLIT", False)
        want = skinny_linear(x, w, bias, config)
        monkeypatch.setattr(split_k_sum, "SUM_IN_LAST_SPLIT", True)
        got = skinny_linear(x, w, bias, config)
        assert torch.equal(got, want)
        assert not counts.any()
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b.float()), rtol=2**-7, atol=1e-3 * 72**0.5)


def test_a_split_without_counters_sums_in_a_second_kernel(monkeypatch) -> None:
    """Too many tiles for the counters (or a capture before they exist), or programs of more than
    16 rows: the sum kernel runs."""
    launched = []
    real = split_k_sum._sum_splits_kernel
    monkeypatch.setattr(split_k_sum, "_sum_splits_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: launched.append(grid) or real[grid]})())
    x, w = torch.randn(3, 64), torch.randn(32, 64)
    skinny_linear(x, w, config=SkinnyConfig(16, 16, 16, 4))
    assert launched == []
    torch.testing.assert_close(skinny_linear(x, w, config=SkinnyConfig(32, 16, 16, 4)), F.linear(x, w))
    assert len(launched) == 1
    launched.clear()
    monkeypatch.setattr(split_k_sum, "TILE_COUNTS", 1)
    torch.testing.assert_close(skinny_linear(x, w, config=SkinnyConfig(16, 16, 16, 4)), F.linear(x, w))
    assert len(launched) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_is_added_once_with_and_without_split(dtype) -> None:
    for config in (SkinnyConfig(1, 8, 64, 1), SkinnyConfig(1, 8, 64, 4), SkinnyConfig(16, 16, 64, 4)):
        check(3 if config.block_m == 16 else 1, 48, 256, dtype, config, bias=True, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [65, 100, 128, 200])
def test_row_tiles_past_64_rows_match_torch(dtype, rows) -> None:
    """Several row tiles, the last one partial, with the default tiles (split-K at these widths)
    and without a split."""
    check(rows, 48, 160, dtype, bias=True, seed=6)
    check(rows, 36, 300, dtype, SkinnyConfig(64, 32, 64, 1), seed=7)


def test_zero_rows_give_an_empty_output() -> None:
    assert skinny_linear(torch.empty(0, 64), torch.randn(32, 64)).shape == (0, 32)


def test_bad_inputs_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="contiguous weight"):
        skinny_linear(torch.randn(2, 64), torch.randn(64, 32).T)
    with pytest.raises(ValueError, match="at most 512 rows"):
        skinny_linear(torch.randn(513, 64), torch.randn(32, 64))
    with pytest.raises(ValueError, match="cannot take 4 rows"):
        skinny_linear(torch.randn(4, 64), torch.randn(32, 64), config=SkinnyConfig(2, 8, 64, 1))


def test_tiles_fill_the_device_and_split_k_only_when_columns_are_few() -> None:
    # Qwen3-0.6B's layers on 132 SMs
    for rows in (1, 2, 4, 8, 16, 32):
        for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)):
            cfg = skinny_config(rows, n, k, 132)
            programs = -(-n // cfg.block_n) * cfg.split_k
            assert programs >= 132, (rows, n, k, cfg)
            assert cfg.block_m >= rows and (cfg.block_m <= 2 or cfg.block_m >= 16)
    assert skinny_config(1, 24576, 4096, 132).split_k == 1
    assert skinny_config(16, 1024, 2048, 132).split_k > 1
    for rows in (64, 100, 256, 512):   # past ROW_TILE the row tiles count toward filling the device
        for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)):
            cfg = skinny_config(rows, n, k, 132)
            programs = -(-n // cfg.block_n) * -(-rows // cfg.block_m) * cfg.split_k
            assert programs >= 132 and cfg.block_m >= 16, (rows, n, k, cfg)


def test_layers_keep_f_linear_on_the_cpu() -> None:
    torch.manual_seed(0)
    packed = PackedLinear(64, {"a": (32, 0, 32), "b": (48, 0, 48)}, bias=True)
    row = RowParallelLinear(80, 64)
    for layer in (packed, row):
        assert layer.skinny_rows == frozenset()
        x = torch.randn(3, layer.in_features)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_layers_use_the_skinny_kernel_in_winning_buckets_while_graphs_are_built(monkeypatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(PackedLinear(64, {"a": (32, 0, 32)}, bias=True), RowParallelLinear(32, 64))
    assert enable_skinny_gemm(model, {(32, 64, 1), (32, 64, 4), (64, 48, 2)}) == 1
    packed, row = model
    assert packed.skinny_rows == {1, 4} and row.skinny_rows == frozenset()
    calls = []
    monkeypatch.setattr(small_gemm, "skinny_linear",
                        lambda x, *args: calls.append(x.shape[0]) or skinny_linear(x, *args))
    packed(torch.randn(1, 64))
    assert calls == []   # an eager step (no graphs being built): cuBLAS, whose launch costs less
    with building_graphs():
        for rows in (1, 3, 4, 5):   # 3 falls in bucket 4; 5 in bucket 8, which cuBLAS keeps
            x = torch.randn(rows, 64)
            torch.testing.assert_close(packed(x), F.linear(x, packed.weight, packed.bias),
                                       rtol=1e-5, atol=1e-5)
        row(torch.randn(1, 32))
    assert calls == [1, 3, 4]
    packed(torch.randn(1, 64))
    assert calls == [1, 3, 4]


def test_row_buckets_are_the_powers_of_two_up_to_the_batch() -> None:
    assert [row_bucket(r) for r in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]
    assert row_buckets(1) == [1] and row_buckets(12) == [1, 2, 4, 8, 16]
    assert row_buckets(256) == [1, 2, 4, 8, 16, 32]
    assert describe({(32, 64, 4), (32, 64, 1)}) == "32x64 at rows 1,4" and describe(set()) == "no shape"


@pytest.mark.parametrize("rows", [1, 5])
def test_the_startup_check_passes_the_kernel_and_catches_a_wrong_one(rows) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w = torch.randn(80, 96, generator=gen).bfloat16()
    assert agrees_with_cublas(skinny_linear, x, w)

    def off_by_one_column(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, w.roll(1, dims=0))

    def dropped_tail(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x[:, :64].contiguous(), w[:, :64].contiguous())

    assert not agrees_with_cublas(off_by_one_column, x, w)
    assert not agrees_with_cublas(dropped_tail, x, w)


def check_gated(rows: int, n: int, k: int, dtype: torch.dtype, config: SkinnyConfig | None = None,
                seed: int = 0) -> None:
    """The gated kernel against torch over silu(gate) * up.

    In float32 only the order of sums differs. In bf16 each x is rounded once more before the
    product, as the separate SiLU-mul kernel stores it; the interpreter rounds toward zero there
    (a GPU to nearest), up to 2^-7 of x: over k products of unit weights the sum moves by about
    sqrt(k) 2^-8 rms(x), allowed 8 times that here (any wrong gate, up or SiLU is off by the
    size of the output itself)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rows * 7 + n + k)
    gate_up = (2 * torch.randn(rows, 2 * k, generator=gen)).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    x = F.silu(gate) * up
    got = skinny_linear(gate_up, w, config=config, gated=True)
    assert got.shape == (rows, n) and got.dtype == dtype
    rtol, atol = TOL[dtype]
    if dtype != torch.float32:
        atol = 2**-5 * x.pow(2).mean().sqrt().item()
    torch.testing.assert_close(got.float(), x @ w.float().T, rtol=rtol, atol=atol * k ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 32, 40, 100])
def test_gated_input_matches_silu_mul_then_the_product(dtype, rows) -> None:
    """The CUDA-core rows (1-2), tl.dot rows, and row tiles past 64, with a ragged K and N."""
    check_gated(rows, 36, 300, dtype, seed=8)
    check_gated(rows, 48, 160, dtype, seed=9)


@pytest.mark.parametrize("config", [SkinnyConfig(1, 8, 64, 4), SkinnyConfig(2, 4, 64, 1),
                                    SkinnyConfig(16, 16, 32, 3), SkinnyConfig(64, 32, 64, 2)],
                         ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}")
def test_gated_input_with_split_k_and_even_k(config) -> None:
    for rows in sorted({1, config.block_m}):
        check_gated(rows, 37, 256, torch.float32, config, seed=10)


def test_a_gated_input_must_be_twice_the_weights_width() -> None:
    with pytest.raises(ValueError, match="width 63 \\(gated\\)"):
        skinny_linear(torch.randn(2, 63), torch.randn(32, 31), gated=True)
    with pytest.raises(ValueError, match="width 64 \\(gated\\)"):
        skinny_linear(torch.randn(2, 64), torch.randn(32, 64), gated=True)


def test_a_gated_mlps_down_takes_gate_and_up_itself_only_in_its_gated_buckets(monkeypatch) -> None:
    from nanoserve.runner.layers.ops import silu_mul

    torch.manual_seed(1)
    down, other = RowParallelLinear(32, 64), RowParallelLinear(32, 64)
    down.takes_gated_input = True
    model = torch.nn.Sequential(down, other)
    wins = {(64, 32, 1), (64, 32, 2), (64, 32, 4)}
    assert enable_skinny_gemm(model, wins, gated={(64, 32, 1), (64, 32, 4), (64, 32, 8)}) == 2
    # gated buckets stay within the skinny wins, and only on a layer that takes a gated input
    assert down.gated_rows == {1, 4} and other.gated_rows == frozenset()
    calls = []
    monkeypatch.setattr(small_gemm, "skinny_linear",
                        lambda x, *args, **kw: calls.append((x.shape[0], kw.get("gated", False)))
                        or skinny_linear(x, *args, **kw))
    gate_up = torch.randn(1, 64)
    want = F.linear(silu_mul(gate_up), down.weight)
    torch.testing.assert_close(down.forward_gated(gate_up, silu_mul), want)
    assert calls == []   # eager: SiLU-mul and cuBLAS
    with building_graphs():
        for rows in (1, 2, 3):
            gate_up = torch.randn(rows, 64)
            torch.testing.assert_close(down.forward_gated(gate_up, silu_mul),
                                       F.linear(silu_mul(gate_up), down.weight), rtol=1e-5, atol=1e-5)
    # bucket 2 is a plain skinny win only: SiLU-mul apart, then the plain kernel
    assert calls == [(1, True), (2, False), (3, True)]


def check_normed(rows: int, n: int, k: int, dtype: torch.dtype, residual: bool, bias: bool = False,
                 config: SkinnyConfig | None = None, seed: int = 0) -> None:
    """The product of the norm's output, and the new residual, against add + RMSNorm apart. float32
    and float16 only: the interpreter casts to bf16 by truncation, where a GPU rounds."""
    from nanoserve.runner.layers.ops import add_rms_norm, rms_norm
    from nanoserve.runner.layers.small_gemm import skinny_linear_normed

    gen = torch.Generator().manual_seed(seed * 1000 + rows * 7 + n + k)
    x, res = (torch.randn(rows, k, generator=gen).to(dtype) for _ in range(2))
    gamma = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    normed, summed = add_rms_norm(x, res, gamma, 1e-6) if residual else (rms_norm(x, gamma, 1e-6), x)
    got, new_residual = skinny_linear_normed(x, res if residual else None, gamma, 1e-6, w, b, config)
    assert torch.equal(new_residual, summed)
    rtol, atol = TOL[dtype]
    want = normed.float() @ w.float().T + (b.float() if bias else 0)
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol * k ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("residual", [True, False])
def test_normed_input_matches_add_rms_norm_then_the_product(dtype, rows, residual) -> None:
    """Ragged K and N, default tiles and a K split with several K steps, bias or none."""
    check_normed(rows, 36, 300, dtype, residual, seed=11)
    check_normed(rows, 40, 96, dtype, residual, bias=True, config=SkinnyConfig(rows, 8, 32, 2), seed=12)


def test_a_normed_input_takes_one_or_two_rows_only() -> None:
    from nanoserve.runner.layers.small_gemm import skinny_linear_normed

    with pytest.raises(ValueError, match="1-2 contiguous rows"):
        skinny_linear_normed(torch.randn(3, 32), torch.randn(3, 32), torch.ones(32), 1e-6, torch.randn(8, 32))
    with pytest.raises(ValueError, match="1-2 row tiles"):
        skinny_linear_normed(torch.randn(1, 32), None, torch.ones(32), 1e-6, torch.randn(8, 32),
                             config=SkinnyConfig(16, 16, 32, 1))


def test_a_projection_after_a_norm_folds_it_in_only_in_its_normed_buckets(monkeypatch) -> None:
    from nanoserve.runner.layers.norm import RMSNorm

    torch.manual_seed(2)
    qkv, other = PackedLinear(32, {"q": (48, 0, 48)}), PackedLinear(32, {"q": (48, 0, 48)})
    qkv.takes_normed_input = True
    norm = RMSNorm(32)
    norm.weight.data.uniform_(0.5, 1.5)
    assert enable_skinny_gemm(torch.nn.Sequential(qkv, other), {(48, 32, 2)}, normed={(48, 32, 1)}) == 2
    assert qkv.normed_rows == {1} and other.normed_rows == frozenset()
    calls = []
    real = small_gemm.skinny_linear_normed
    monkeypatch.setattr(small_gemm, "skinny_linear_normed",
                        lambda x, *args, **kw: calls.append(x.shape[0]) or real(x, *args, **kw))

    def apart(x, residual):
        if residual is None:
            return F.linear(norm(x), qkv.weight), x
        h, summed = norm(x, residual)
        return F.linear(h, qkv.weight), summed

    for rows, residual in ((1, True), (1, False), (2, True)):
        x, res = torch.randn(rows, 32), (torch.randn(rows, 32) if residual else None)
        want = apart(x, res)
        before = len(calls)
        got = qkv.forward_normed(x, res, norm)
        assert len(calls) == before   # eager: the norm, then cuBLAS
        with building_graphs():
            got = qkv.forward_normed(x, res, norm)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # bucket 2 has no normed win: the norm apart there
    assert calls == [1, 1]
