"""The FP8 (e4m3) KV cache: quantization on store, dequantization inside the Triton kernels
(under the Triton interpreter here; tests/gpu/test_fp8_kv_cache_gpu.py runs them on the GPU) and
in the torch reference, the backends that refuse it, its sizing, and scales from checkpoints.

Accuracy bound: on fresh random inputs (N(0, 1) keys and values, or N(0, 300) with scales 4 and
8), attention over an fp8 cache stays within FP8_REL_ERR (norm of the error over the norm of the
output) of the same attention over the unquantized float32 cache; measured 0.029-0.036.
The kernels agree with the torch reference over the same fp8 cache to ~2e-7 (float32 queries)
and ~2e-4 (float16).
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.config import EngineConfig
from nanoserve.runner.attention import TorchBackend, select_backend
from nanoserve.runner.attention.fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8
from nanoserve.runner.attention.kv_layout import tokens_contiguous, v_cache_copy
from nanoserve.runner.attention.torch_backend import store_kv
from nanoserve.runner.attention.triton_kernels import TritonBackend, store_kvcache
from nanoserve.runner.kv_cache import KVCache, block_bytes, blocks_for_cpu
from tests.runner.test_triton_attention import make_step

if torch.cuda.is_available():
    pytest.skip("the GPU versions of these checks live in tests/gpu", allow_module_level=True)

FP8_REL_ERR = 0.05
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}   # a kernel against the reference, same cache


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.isfinite().all()
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def fp8_step(specs, *, dtype, magnitude=1.0, k_scale=1.0, v_scale=1.0, seed, **shape):
    """make_step with its K/V history and new K/V times `magnitude`: the unquantized float32
    caches (the exact reference) and their fp8 copies, scaled by k_scale / v_scale."""
    q, k, v, k_cache, v_cache, meta = make_step(specs, dtype=torch.float32, seed=seed, **shape)
    k, v, k_cache, v_cache = (t * magnitude for t in (k, v, k_cache, v_cache))
    fp8_caches = quantize_fp8(k_cache, k_scale), quantize_fp8(v_cache, v_scale)
    return q.to(dtype), k.to(dtype), v.to(dtype), (k_cache, v_cache), fp8_caches, meta


def in_layout(caches: tuple[torch.Tensor, torch.Tensor], v_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) with V as the engine lays out an fp8 cache ("tokens": kv_layout.py) or row by row."""
    k_cache, v_cache = caches
    if v_layout == "rows":
        return k_cache, v_cache
    moved = v_cache_copy(v_cache)
    assert tokens_contiguous(moved) and torch.equal(moved.float(), v_cache.float())
    return k_cache, moved


def fp8_case(specs, dtype, magnitude, k_scale, v_scale, seed, **shape):
    """fp8_step with q brought back to unit size and head dim ** -0.5 as the scale, and the torch
    reference twice: over copies of the fp8 caches (what a kernel must match; the copies end up
    holding the reference's stores) and over the exact float32 caches (the quantization's error)."""
    q, k, v, exact, fp8, meta = fp8_step(specs, dtype=dtype, magnitude=magnitude, k_scale=k_scale,
                                         v_scale=v_scale, seed=seed, kv_heads=2, **shape)
    q = (q.float() / magnitude).to(dtype)
    scale = shape["head_dim"] ** -0.5
    ref_caches = tuple(c.clone() for c in fp8)
    ref = TorchBackend().forward(q.float(), k.float(), v.float(), *ref_caches, meta, scale, k_scale, v_scale)
    exact_out = TorchBackend().forward(q.float(), k.float(), v.float(), *exact, meta, scale)
    return q, k, v, fp8, meta, scale, ref, exact_out, ref_caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 3.0)])
@pytest.mark.parametrize("v_layout", ["rows", "tokens"])
def test_triton_store_quantizes_like_the_torch_reference_bit_for_bit(dtype, k_scale, v_scale, v_layout) -> None:
    gen = torch.Generator().manual_seed(1)
    kv_heads, head_dim = 3, 64   # 3 heads: a masked head tile
    slots = torch.tensor([5, -1, 63, 16, -1, 0], dtype=torch.int64)
    # every magnitude class: subnormal e4m3, normal, and past FP8_MAX (saturates)
    kv = torch.randn(len(slots), 2, kv_heads, head_dim, generator=gen)
    kv = (kv * torch.logspace(-4, 3, head_dim)).to(dtype)
    kv[0, :, 0, :2] = torch.tensor([-0.0, 0.0])   # signed zeros keep their sign
    kv[2, :, 1, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])   # stored as 0, +-FP8_MAX
    k, v = kv[:, 0], kv[:, 1]
    poison = torch.full((4, 16, kv_heads, head_dim), 0.5).to(FP8_DTYPE)
    caches = in_layout((poison.clone(), poison.clone()), v_layout)
    ref = in_layout((poison.clone(), poison.clone()), v_layout)
    store_kvcache(k, v, *caches, slots, k_scale, v_scale)
    store_kv(k, v, *ref, slots, k_scale, v_scale)
    for got, want in zip(caches, ref):
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    untouched = torch.ones(4 * 16, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    for cache in caches:
        flat = cache.float().reshape(-1, kv_heads, head_dim)
        assert (flat[~untouched] != 0.5).any() and (flat[untouched] == 0.5).all()


def test_fp8_values_read_back_within_half_an_e4m3_step_or_saturate() -> None:
    scale = 2.0
    x = torch.randn(10000, generator=torch.Generator().manual_seed(2)) * torch.logspace(-5, 3, 10000)
    back = quantize_fp8(x, scale).float() * scale
    inside = x.abs() <= FP8_MAX * scale
    # e4m3 keeps 3 mantissa bits: half a step is 2**-4 of the value; below 2**-6 (subnormals)
    # the step is 2**-9, so half of it is 2**-10 (times the scale everywhere)
    bound = torch.maximum(x.abs() * 2**-4, torch.tensor(2**-10 * scale))
    assert ((back - x).abs() <= bound)[inside].all()
    assert torch.equal(back[~inside], FP8_MAX * scale * x[~inside].sign())


def test_torch_reference_over_an_fp8_cache_stays_near_the_exact_one() -> None:
    specs = [(23, 23), (9, 49), (1, 70), (1, 0), (17, 50)]
    shape = dict(block_size=16, kv_heads=2, group=2, head_dim=64)
    for magnitude, k_scale, v_scale, seed in ((1.0, 1.0, 1.0, 3), (300.0, 4.0, 8.0, 4)):
        q, k, v, exact, fp8, meta = fp8_step(specs, dtype=torch.float32, magnitude=magnitude,
                                             k_scale=k_scale, v_scale=v_scale, seed=seed, **shape)
        q = q / magnitude   # keep the scores of both cases in the same range
        want = TorchBackend().forward(q, k, v, *exact, meta, 0.125)
        got = TorchBackend().forward(q, k, v, *fp8, meta, 0.125, k_scale, v_scale)
        assert 0 < rel_err(got, want) < FP8_REL_ERR


DECODE_CASES = [
    # dtype, head_dim, group, num_splits, magnitude, k_scale, v_scale, seed
    (torch.float32, 64, 2, 1, 1.0, 1.0, 1.0, 11),
    (torch.float16, 64, 4, 3, 1.0, 1.0, 1.0, 12),
    (torch.float32, 128, 1, 3, 300.0, 4.0, 8.0, 13),
    (torch.float16, 64, 2, 1, 300.0, 4.0, 8.0, 14),
    # a bf16 query: by default the cache widens to f16 (the interpreter cannot widen e4m3 to bf16)
    (torch.bfloat16, 64, 4, 3, 1.0, 1.0, 1.0, 15),
    (torch.bfloat16, 128, 2, 1, 300.0, 4.0, 8.0, 16),
]


@pytest.mark.parametrize("dtype,head_dim,group,num_splits,magnitude,k_scale,v_scale,seed",
                         DECODE_CASES)
@pytest.mark.parametrize("v_layout", ["rows", "tokens"])
def test_triton_decode_over_fp8_matches_the_reference(
        dtype, head_dim, group, num_splits, magnitude, k_scale, v_scale, seed, v_layout) -> None:
    from nanoserve.runner.attention.triton_decode import paged_decode
    specs = [(1, 70), (1, 0), (1, 33), (1, 5)]
    q, k, v, fp8, meta, scale, ref, exact_out, ref_caches = fp8_case(
        specs, dtype, magnitude, k_scale, v_scale, seed, block_size=16, group=group, head_dim=head_dim)
    fp8 = in_layout(fp8, v_layout)   # past each sequence's end its blocks hold random values: read, never used
    store_kvcache(k, v, *fp8, meta.slot_mapping, k_scale, v_scale)
    out = paged_decode(q, *fp8, meta.seq_lens, meta.block_tables, scale, meta.max_seq_len,
                       num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
    assert (out[1] == 0).all(), "a padding row must come back as zeros"
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(out, exact_out) < FP8_REL_ERR
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(fp8, ref_caches))


PREFILL_CASES = [
    # dtype, block_size, head_dim, group, magnitude, k_scale, v_scale, seed
    (torch.float32, 16, 64, 2, 1.0, 1.0, 1.0, 21),
    (torch.float16, 32, 64, 4, 1.0, 1.0, 1.0, 22),
    (torch.float32, 32, 128, 2, 300.0, 4.0, 8.0, 23),
]


@pytest.mark.parametrize("dtype,block_size,head_dim,group,magnitude,k_scale,v_scale,seed",
                         PREFILL_CASES)
@pytest.mark.parametrize("v_layout", ["rows", "tokens"])
def test_triton_prefill_over_fp8_matches_the_reference(
        dtype, block_size, head_dim, group, magnitude, k_scale, v_scale, seed, v_layout) -> None:
    # a fresh prompt, a prefix hit, a chunk after a chunk, and a decode row
    specs = [(23, 23), (9, 49), (17, 50), (1, 38)]
    q, k, v, fp8, meta, scale, ref, exact_out, _ = fp8_case(
        specs, dtype, magnitude, k_scale, v_scale, seed, block_size=block_size, group=group,
        head_dim=head_dim)
    fp8 = in_layout(fp8, v_layout)
    out = TritonBackend().forward(q, k, v, *fp8, meta, scale, k_scale, v_scale)
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(out, exact_out) < FP8_REL_ERR


@pytest.mark.parametrize("v_layout", ["rows", "tokens"])
def test_backend_decode_path_applies_the_scales(v_layout) -> None:
    q, k, v, exact, fp8, meta = fp8_step([(1, 40), (1, 0), (1, 17)], dtype=torch.float32,
                                         magnitude=300.0, k_scale=4.0, v_scale=8.0, seed=31,
                                         block_size=16, kv_heads=2, group=2, head_dim=64)
    fp8 = in_layout(fp8, v_layout)
    assert meta.decode_only
    q = q / 300.0
    ref = TorchBackend().forward(q, k, v, *(c.clone() for c in fp8), meta, 0.125, 4.0, 8.0)
    out = TritonBackend().forward(q, k, v, *fp8, meta, 0.125, 4.0, 8.0)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_flash_attn_refuses_fp8_and_auto_picks_triton_instead(monkeypatch) -> None:
    import nanoserve.runner.attention as attention
    monkeypatch.setattr(attention, "_flash_attn_imports", lambda: True)
    with pytest.raises(ValueError, match="flash_attn backend cannot read an fp8 KV cache; use "
                                         "--attention-backend triton"):
        select_backend("flash_attn", "cuda", 256, "fp8")
    assert select_backend("auto", "cuda", 256, "fp8").name == "triton"
    assert select_backend("auto", "cpu", 16, "fp8").name == "torch"


def test_an_fp8_cache_takes_one_byte_per_element_so_twice_the_bf16_tokens_fit() -> None:
    bf16 = EngineConfig(device="cpu", dtype="bfloat16")
    fp8 = EngineConfig(device="cpu", dtype="bfloat16", kv_cache_dtype="fp8")
    assert block_bytes(bf16) == 2 * block_bytes(fp8)
    assert blocks_for_cpu(fp8) == 2 * blocks_for_cpu(bf16)
    assert KVCache(fp8, 2, torch.device("cpu")).tensor.dtype == FP8_DTYPE
    assert KVCache(bf16, 2, torch.device("cpu")).tensor.dtype == torch.bfloat16


def test_an_fp8_cache_is_zeroed_and_lays_v_out_along_tokens() -> None:
    fp8 = EngineConfig(device="cpu", dtype="bfloat16", kv_cache_dtype="fp8")
    cache = KVCache(fp8, 3, torch.device("cpu"))
    k_cache, v_cache = cache.layer(1)
    assert k_cache.stride(-1) == 1 and tokens_contiguous(v_cache)
    assert k_cache.shape == v_cache.shape and not cache.tensor.float().any()
    bf16 = KVCache(EngineConfig(device="cpu", dtype="bfloat16"), 3, torch.device("cpu"))
    assert all(c.is_contiguous() for c in bf16.layer(1))


def test_a_nan_is_stored_as_zero_so_no_read_past_a_sequence_end_can_meet_one() -> None:
    k = torch.randn(2, 2, 64)
    v = torch.randn(2, 2, 64)
    k[0, 1, 3] = v[1, 0, 7] = float("nan")
    caches = in_layout((torch.full((2, 16, 2, 64), 1.0).to(FP8_DTYPE),) * 2, "tokens")
    caches = (caches[0].clone(), caches[1])
    store_kvcache(k, v, *caches, torch.tensor([3, 20]))
    assert all(c.float().isfinite().all() for c in caches)
    assert caches[0][0, 3, 1, 3].float() == 0 and caches[1][1, 4, 0, 7].float() == 0
