"""The FP8 (e4m3) KV cache on the GPU: the Triton store against torch's cast bit for bit, and the
Triton decode and prefill kernels over an fp8 cache against the torch reference (float32) over
the same cache and over the unquantized one, eagerly and under CUDA graph replay; the bundled
model's greedy picks with an fp8 cache.

Bounds: FP8_REL_ERR (0.05) of the exact output, as on the CPU (tests/runner/test_fp8_kv_cache.py,
where 0.029-0.036 is measured); the kernels against the reference over the same fp8 cache within
the bf16/fp16 tolerances of tests/gpu/test_attention_kernels.py."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM
from nanoserve.runner.attention import TorchBackend, select_backend
from nanoserve.runner.attention.fp8 import FP8_DTYPE, quantize_fp8
from nanoserve.runner.attention.kv_layout import v_cache_copy
from nanoserve.runner.attention.torch_backend import store_kv
from nanoserve.runner.attention.triton_decode import paged_decode
from nanoserve.runner.attention.triton_kernels import TritonBackend, store_kvcache
from nanoserve.runner.batch import AttentionMetadata
from tests.gpu.test_attention_kernels import TOL, decode_specs, make_step, prefill_specs

pytestmark = pytest.mark.gpu

FP8_REL_ERR = 0.05
MAGNITUDES = {1.0: (1.0, 1.0), 300.0: (4.0, 8.0)}   # K/V magnitude -> (k_scale, v_scale)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.isfinite().all()
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def fp8_step(specs, *, dtype, magnitude, seed, **shape):
    """make_step's inputs with K/V times `magnitude` and q over it (scores stay in range): q, k,
    v in `dtype`, the exact float32 caches, their fp8 copies, meta, and the scales."""
    k_scale, v_scale = MAGNITUDES[magnitude]
    q, k, v, k_cache, v_cache, meta = make_step(specs, dtype=torch.float32, seed=seed, **shape)
    k, v, k_cache, v_cache = (t * magnitude for t in (k, v, k_cache, v_cache))
    fp8 = quantize_fp8(k_cache, k_scale), quantize_fp8(v_cache, v_scale)
    return ((q / magnitude).to(dtype), k.to(dtype), v.to(dtype), (k_cache, v_cache), fp8, meta,
            (k_scale, v_scale))


def engine_layout(caches: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) of an fp8 cache with V copied into the engine's layout (kv_layout.py): same values."""
    return caches[0], v_cache_copy(caches[1])


def check_fp8(specs, *, dtype, magnitude, seed, num_splits=None, config=None, v_layout="tokens", **shape):
    """v_layout: V as the engine lays out an fp8 cache ("tokens": kv_layout.py) or row by row."""
    q, k, v, exact, fp8, meta, scales = fp8_step(specs, dtype=dtype, magnitude=magnitude, seed=seed,
                                                 **shape)
    if v_layout == "tokens":
        fp8 = engine_layout(fp8)
    scale = q.shape[-1] ** -0.5
    ref_caches = tuple(c.clone() for c in fp8)
    ref = TorchBackend().forward(q.float(), k.float(), v.float(), *ref_caches, meta, scale, *scales)
    exact_out = TorchBackend().forward(q.float(), k.float(), v.float(), *exact, meta, scale)
    if num_splits is None and config is None:
        out = TritonBackend().forward(q, k, v, *fp8, meta, scale, *scales)
    else:
        store_kvcache(k, v, *fp8, meta.slot_mapping, *scales)
        out = paged_decode(q, *fp8, meta.seq_lens, meta.block_tables, scale, meta.max_seq_len,
                           num_splits=num_splits, k_scale=scales[0], v_scale=scales[1], config=config)
    if meta.decode_only:
        assert (out[meta.seq_lens == 0] == 0).all(), "padding rows must come back as zeros"
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(out, exact_out) < FP8_REL_ERR
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fp8, ref_caches))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("magnitude", sorted(MAGNITUDES))
def test_triton_store_casts_like_torch_bit_for_bit(dtype, magnitude):
    k_scale, v_scale = MAGNITUDES[magnitude]
    gen = torch.Generator(device="cuda").manual_seed(1)
    slots = torch.randperm(4096, device="cuda")[:1000]
    slots[::7] = -1
    # every magnitude class: subnormal e4m3, normal, and past 448 * scale (saturates)
    kv = torch.randn(1000, 2, 8, 128, device="cuda", generator=gen)
    kv = (kv * torch.logspace(-4, 3, 128, device="cuda") * magnitude).to(dtype)
    caches = [torch.zeros(256, 16, 8, 128, device="cuda", dtype=FP8_DTYPE) for _ in range(4)]
    store_kvcache(kv[:, 0], kv[:, 1], caches[0], caches[1], slots, k_scale, v_scale)
    store_kv(kv[:, 0], kv[:, 1], caches[2], caches[3], slots, k_scale, v_scale)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


CASES = [
    # dtype, block_size, head_dim, group, magnitude, seed
    (torch.bfloat16, 16, 128, 1, 1.0, 1),
    (torch.float16, 16, 64, 4, 300.0, 2),
    (torch.bfloat16, 64, 64, 8, 1.0, 3),
    (torch.bfloat16, 256, 128, 2, 300.0, 4),
    (torch.float16, 256, 128, 8, 1.0, 5),
]


@pytest.mark.parametrize("dtype,block_size,head_dim,group,magnitude,seed", CASES)
@pytest.mark.parametrize("v_layout", ["tokens", "rows"])
def test_triton_decode_over_fp8_batch_mix(dtype, block_size, head_dim, group, magnitude, seed, v_layout):
    check_fp8(decode_specs(random.Random(seed), batch=29, max_len=3000), dtype=dtype,
              magnitude=magnitude, seed=seed, block_size=block_size, group=group,
              head_dim=head_dim, kv_heads=2, v_layout=v_layout)


@pytest.mark.parametrize("dtype,block_size,head_dim,group,magnitude,seed", CASES[::2])
@pytest.mark.parametrize("num_splits", [2, 7])
def test_triton_decode_over_fp8_forced_splits(dtype, block_size, head_dim, group, magnitude, seed,
                                              num_splits):
    check_fp8(decode_specs(random.Random(seed + 100), batch=5, max_len=2000), dtype=dtype,
              magnitude=magnitude, seed=seed + 100, num_splits=num_splits, block_size=block_size,
              group=group, head_dim=head_dim, kv_heads=2)


@pytest.mark.parametrize("group,magnitude,seed", [(2, 1.0, 21), (4, 300.0, 22)])
def test_triton_decode_widening_fp8_to_bf16_for_a_bf16_query(group, magnitude, seed):
    """The bf16 widening that bench/attention_kernels.py --fp8-sweep weighs against the default f16."""
    from nanoserve.runner.attention.decode_tiles import decode_config

    config = dict(decode_config(torch.device("cuda"), fp8=True), FP8_VIA_F16=False)
    check_fp8(decode_specs(random.Random(seed), batch=29, max_len=3000), dtype=torch.bfloat16,
              magnitude=magnitude, seed=seed, config=config,
              block_size=256, group=group, head_dim=128, kv_heads=2)


def test_triton_decode_over_fp8_32k_context_at_batch_1():
    check_fp8([(1, 32768)], dtype=torch.bfloat16, magnitude=300.0, seed=8, block_size=256,
              group=2, head_dim=128, kv_heads=8)


@pytest.mark.parametrize("dtype,block_size,head_dim,group,magnitude,seed", CASES)
@pytest.mark.parametrize("v_layout", ["tokens", "rows"])
def test_triton_prefill_over_fp8_with_prefix_history(dtype, block_size, head_dim, group, magnitude,
                                                     seed, v_layout):
    check_fp8(prefill_specs(random.Random(seed + 200), max_len=700), dtype=dtype,
              magnitude=magnitude, seed=seed + 200, block_size=block_size, group=group,
              head_dim=head_dim, kv_heads=2, v_layout=v_layout)


def test_triton_decode_over_fp8_under_cuda_graph_replay():
    """Capture at max_model_len with the scales, then replay over new lengths, tables, padding."""
    max_model_len, batch, block_size = 4096, 8, 64
    max_blocks = max_model_len // block_size
    shape = dict(block_size=block_size, kv_heads=8, group=2, head_dim=128,
                 max_blocks=max_blocks, num_blocks=batch * max_blocks + 4)
    specs = decode_specs(random.Random(10), batch=batch - 2, max_len=max_model_len)
    q, k, v, _, fp8, meta, scales = fp8_step(specs, dtype=torch.bfloat16, magnitude=300.0,
                                             seed=10, **shape)
    fp8 = engine_layout(fp8)
    capture_meta = AttentionMetadata(
        meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        max_query_len=1, max_seq_len=max_model_len, query_lens_host=[], seq_lens_host=[])
    backend = select_backend("triton", "cuda", block_size, "fp8")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # compile and warm up outside the capture
        backend.forward(q, k, v, *(c.clone() for c in fp8), capture_meta, 0.1, *scales)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, *fp8, capture_meta, 0.1, *scales)

    for seed in (11, 12):
        specs = decode_specs(random.Random(seed), batch=batch - 3, max_len=max_model_len, padding=3)
        nq, nk, nv, exact, nfp8, new_meta, _ = fp8_step(specs, dtype=torch.bfloat16,
                                                        magnitude=300.0, seed=seed, **shape)
        for static, fresh in ((q, nq), (k, nk), (v, nv), (fp8[0], nfp8[0]), (fp8[1], nfp8[1]),
                              (meta.slot_mapping, new_meta.slot_mapping),
                              (meta.seq_lens, new_meta.seq_lens),
                              (meta.block_tables, new_meta.block_tables)):
            static.copy_(fresh)
        ref = TorchBackend().forward(q.float(), k.float(), v.float(), *(c.clone() for c in fp8),
                                     new_meta, 0.1, *scales)
        exact_out = TorchBackend().forward(q.float(), k.float(), v.float(), *exact, new_meta, 0.1)
        graph.replay()
        real = new_meta.seq_lens > 0
        assert (out[~real] == 0).all()
        assert rel_err(out[real], ref[real]) < TOL[torch.bfloat16]
        assert rel_err(out[real], exact_out[real]) < FP8_REL_ERR


def test_bundled_model_fp8_cache_picks_the_auto_caches_greedy_token_at_90_percent_of_steps():
    """As tests/engine/test_fp8_kv_cache_llm.py (97.0% on the CPU), on the GPU through the Triton
    kernels and CUDA graphs, float32 compute."""
    from nanoserve.benchmarks.fp8_agreement import greedy_agreement

    def llm(kv_cache_dtype: str) -> LLM:
        engine = LLM(device="cuda", dtype="float32", attention_backend="triton", max_model_len=1024,
                     num_kvcache_blocks=64, kv_cache_dtype=kv_cache_dtype)
        assert engine.engine.runner.graphs is not None
        return engine

    agree, free = greedy_agreement(llm)
    print(f"fp8 cache: greedy picks agree at {agree:.1%} of steps given the auto cache's history; "
          f"free-running {free:.1%}")
    assert agree >= 0.9
