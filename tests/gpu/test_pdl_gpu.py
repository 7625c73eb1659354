"""Programmatic dependent launch changes when kernels are scheduled, never what they compute: a
decode-shaped chain of every kernel that takes part, captured in a CUDA graph, gives the same bits
without PDL and with it, replay after replay with new inputs; so do the loads some kernels start
before their wait (the skinny GEMM's first weight tile, decode's L2 prefetch of its first tile)."""

from __future__ import annotations

import pytest
import torch

from nanoserve.runner import pdl
from nanoserve.runner.attention import triton_decode
from nanoserve.runner.layers import small_gemm
from nanoserve.runner.attention.triton_decode import paged_decode
from nanoserve.runner.attention.triton_rope_store import qkv_rope_store
from nanoserve.runner.layers.silu_mul import silu_mul
from nanoserve.runner.layers.small_gemm import skinny_linear, skinny_linear_normed
from nanoserve.runner.sampling_kernel import gumbel_argmax

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, DIM, BLOCK, HIDDEN, INTER, VOCAB = 16, 8, 128, 64, 1024, 3072, 151936
MAX_LEN = 4096


def make_inputs(batch: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    blocks = MAX_LEN // BLOCK
    seq_lens = torch.randint(1, MAX_LEN, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    tables = torch.randperm(batch * blocks, device="cuda", generator=gen).view(batch, blocks).int()
    positions = (seq_lens - 1).long()
    slots = tables.gather(1, (positions // BLOCK)[:, None]).squeeze(1).long() * BLOCK + positions % BLOCK
    return dict(gate_up=randn(batch, 2 * INTER), residual=randn(batch, HIDDEN), seq_lens=seq_lens, tables=tables,
                positions=positions, slots=slots, seeds=torch.randint(0, 2**31, (batch,), device="cuda", generator=gen),
                temperature=torch.full((batch,), 0.7, device="cuda"))


def weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    return dict(down=randn(HIDDEN, INTER, scale=INTER ** -0.5), qkv=randn((HEADS + 2 * KV_HEADS) * DIM, HIDDEN,
                scale=HIDDEN ** -0.5), o=randn(HIDDEN, HEADS * DIM, scale=(HEADS * DIM) ** -0.5),
                head=randn(VOCAB, HIDDEN, scale=HIDDEN ** -0.5), gamma=randn(HIDDEN).abs() + 0.5,
                qn=randn(DIM).abs() + 0.5, kn=randn(DIM).abs() + 0.5)


def chain(x: dict, w: dict, caches: tuple, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    k_cache, v_cache = caches
    h = skinny_linear(silu_mul(x["gate_up"]), w["down"])
    if h.shape[0] <= 2:   # the norm folds into the GEMM at 1-2 rows only
        qkv, residual = skinny_linear_normed(h, x["residual"], w["gamma"], 1e-6, w["qkv"])
    else:
        residual = h + x["residual"]
        qkv = skinny_linear(torch.nn.functional.rms_norm(residual, (HIDDEN,), w["gamma"], 1e-6), w["qkv"])
    q = qkv_rope_store(x["positions"], qkv, HEADS, KV_HEADS, DIM, cos, sin, w["qn"], w["kn"], 1e-6,
                       k_cache, v_cache, x["slots"])
    o = paged_decode(q, k_cache, v_cache, x["seq_lens"], x["tables"], DIM ** -0.5, MAX_LEN)
    y = skinny_linear(o.flatten(1), w["o"])
    logits = torch.nn.functional.linear(y, w["head"])
    return y, residual, gumbel_argmax(logits, x["temperature"], x["seeds"])


@pytest.mark.parametrize("batch", [1, 2, 16])
def test_a_graph_with_pdl_gives_the_same_bits(batch, monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    w = weights()
    angles = torch.arange(MAX_LEN, device="cuda")[:, None] * torch.rand(DIM // 2, device="cuda")[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    outputs = {}
    modes = ("off", "pdl", "pdl, every load after the wait")
    for mode in modes:
        monkeypatch.setenv("NANOSERVE_PDL", "0" if mode == "off" else "1")
        early = mode != "pdl, every load after the wait"
        monkeypatch.setattr(small_gemm, "PRELOAD_FIRST_TILE", early)
        monkeypatch.setattr(triton_decode, "PREFETCH_FIRST_TILE", early)
        pdl.pdl_enabled.cache_clear()
        assert pdl.pdl_enabled(torch.device("cuda")) == (mode != "off")
        torch.manual_seed(1)
        caches = tuple(torch.randn(batch * MAX_LEN // BLOCK, BLOCK, KV_HEADS, DIM, device="cuda").bfloat16()
                       for _ in range(2))
        static = make_inputs(batch, seed=10)
        chain(static, w, caches, cos, sin)   # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static, w, caches, cos, sin)
        runs = []
        for seed in range(11, 16):
            for name, value in make_inputs(batch, seed).items():
                static[name].copy_(value)
            graph.replay()
            runs.append([t.clone() for t in out] + [c.clone() for c in caches])
        outputs[mode] = runs
    pdl.pdl_enabled.cache_clear()
    for mode in modes[1:]:
        for without, with_pdl in zip(outputs["off"], outputs[mode]):
            for a, b in zip(without, with_pdl):
                assert torch.equal(a, b), mode
