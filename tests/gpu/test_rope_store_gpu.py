"""The fused q/k norm + rotary + KV store kernel on the GPU against the unfused path (ops.qkv_rope,
then the torch store) at the Qwen3-0.6B attention shape, bf16, into bf16 and fp8 caches."""

from __future__ import annotations

import pytest
import torch

from nanoserve.runner.attention.fp8 import FP8_DTYPE
from nanoserve.runner.attention.torch_backend import store_kv
from nanoserve.runner.attention.triton_rope_store import qkv_rope_store
from nanoserve.runner.layers.ops import qkv_rope
from nanoserve.runner.layers.rotary import NewTokenRope

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_fused_kernel_matches_qkv_rope_then_store_on_the_gpu(kv_cache_dtype, qk_norm):
    heads, kv_heads, head_dim, tokens, dev = 16, 8, 128, 300, "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=dev, generator=gen).bfloat16()
    positions = torch.randint(0, 4096, (tokens,), device=dev, generator=gen)
    slots = torch.randperm(64 * 256, device=dev, generator=gen)[:tokens]
    slots[::9] = -1
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim))
    emb = torch.arange(4096, device=dev).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((emb, emb), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    weights = ((1 + 0.3 * torch.randn(2, head_dim, device=dev, generator=gen)).bfloat16().unbind(0)
               if qk_norm else (None, None))
    scales = (0.5, 2.0) if kv_cache_dtype == "fp8" else (1.0, 1.0)
    dtype = FP8_DTYPE if kv_cache_dtype == "fp8" else torch.bfloat16
    caches = [torch.zeros(64, 256, kv_heads, head_dim, device=dev, dtype=dtype) for _ in range(4)]
    q_ref, k_ref, v_ref = qkv_rope(positions, qkv, heads, kv_heads, head_dim, cos, sin, *weights, 1e-6)
    store_kv(k_ref, v_ref, caches[0], caches[1], slots, *scales)
    q = qkv_rope_store(positions, qkv, heads, kv_heads, head_dim, cos, sin, *weights, 1e-6,
                       caches[2], caches[3], slots, *scales)
    # the unfused path rounds to bf16 after each op, the fused one once
    assert ((q.float() - q_ref.float()).norm() / q_ref.float().norm()) < 1e-2
    for got, want, scale in ((caches[2], caches[0], scales[0]), (caches[3], caches[1], scales[1])):
        got, want = got.float() * scale, want.float() * scale
        assert ((got - want).norm() / want.norm()) < (3e-2 if kv_cache_dtype == "fp8" else 1e-2)
        written = (want != 0).any(-1).any(-1).flatten()
        assert written.sum() == (slots >= 0).sum()   # padding tokens wrote nothing
        assert torch.equal((got != 0).any(-1).any(-1).flatten(), written)


HEADS, KV_HEADS, DIM, BLOCK = 16, 8, 128, 256   # the 0.6B attention shape, the engine's block


def decode_step_inputs(batch: int, gen: torch.Generator):
    """A decode-only step at the 0.6B shape: (seq_lens of 1-2,048 keys with a padding row in the middle,
    or at batch 1 a lone key; the cache's block count; block tables; the packed bf16 projection;
    rotary tables with q/k norm weights; each row's slot for its new key, -1 for padding)."""
    dev = gen.device
    seq_lens = torch.randint(1, 2049, (batch,), device=dev, generator=gen, dtype=torch.int32)
    seq_lens[batch // 2] = 0 if batch > 1 else 1
    blocks = batch * 8 + 1
    tables = torch.randperm(blocks, device=dev, generator=gen)[:batch * 8].reshape(batch, 8).int()
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * DIM, device=dev, generator=gen).bfloat16()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, DIM, 2, device=dev).float() / DIM))
    emb = torch.arange(4096, device=dev).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((emb, emb), dim=-1)
    weights = (1 + 0.3 * torch.randn(2, DIM, device=dev, generator=gen)).bfloat16().unbind(0)
    positions = (seq_lens - 1).clamp_min(0).long()
    slots = torch.where(seq_lens > 0, tables.long().gather(1, (positions // BLOCK)[:, None])[:, 0] * BLOCK
                        + positions % BLOCK, -1)
    return seq_lens, blocks, tables, qkv, NewTokenRope(emb.cos(), emb.sin(), *weights, 1e-6), slots


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("batch, splits", [(1, None), (16, None), (256, None), (64, 3)])
def test_decode_with_rope_stores_and_attends_as_the_two_launches_on_the_gpu(kv_cache_dtype, batch, splits):
    """paged_decode(rope=...), a decode-only step's one launch, against qkv_rope_store then
    paged_decode, at the 0.6B shape over the engine's cache layouts (an fp8 V along tokens)."""
    from nanoserve.runner.attention.decode_splits import longest_first
    from nanoserve.runner.attention.kv_layout import v_cache_copy
    from nanoserve.runner.attention.triton_decode import paged_decode

    heads, kv_heads, head_dim, block, dev = HEADS, KV_HEADS, DIM, BLOCK, "cuda"
    fp8 = kv_cache_dtype == "fp8"
    gen = torch.Generator(device=dev).manual_seed(batch)
    seq_lens, blocks, tables, qkv, rope, slots = decode_step_inputs(batch, gen)
    weights = (rope.q_weight, rope.k_weight)
    shape = (blocks, block, kv_heads, head_dim)
    caches = [torch.randn(shape, device=dev, generator=gen).to(FP8_DTYPE if fp8 else torch.bfloat16)
              for _ in range(2)]
    if fp8:
        caches[1] = v_cache_copy(caches[1])
    want_k, want_v = (torch.empty_strided(c.shape, c.stride(), dtype=c.dtype, device=dev).copy_(c) for c in caches)
    positions = (seq_lens - 1).clamp_min(0).long()
    scales = dict(k_scale=0.5, v_scale=2.0) if fp8 else {}
    kw = dict(num_splits=splits) if splits else dict(split_keys=512, seq_order=longest_first(seq_lens))
    q = qkv_rope_store(positions, qkv, heads, kv_heads, head_dim, rope.cos, rope.sin, *weights, 1e-6,
                       want_k, want_v, slots, scales.get("k_scale", 1.0), scales.get("v_scale", 1.0))
    want = paged_decode(q, want_k, want_v, seq_lens, tables, head_dim ** -0.5, 2048, **kw, **scales)
    got = paged_decode(qkv[:, :heads * head_dim].unflatten(1, (heads, head_dim)), *caches, seq_lens, tables,
                       head_dim ** -0.5, 2048, rope=rope, **kw, **scales)
    torch.cuda.synchronize()
    written = torch.zeros(blocks * block, dtype=torch.bool, device=dev)
    written[slots[slots >= 0]] = True
    for cache, want_cache in zip(caches, (want_k, want_v)):
        same = (cache.view(torch.uint8) == want_cache.view(torch.uint8)).reshape(blocks * block, -1)
        assert same[~written].all(), "a slot no row owns was written"
        # the same float32 math in both kernels; a contraction into FMAs that the compiler chose
        # differently could move a rare value by a rounding step
        assert same[written].float().mean() > 0.999
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("batch, splits", [(16, None), (256, None), (64, 3)])
def test_decode_storing_new_v_gives_the_store_kernels_cache_and_output_on_the_gpu(batch, splits):
    """paged_decode(new_v=...) after qkv_rope_store(store_v=False): the decode kernel stores each
    row's v into the fp8 cache (V along tokens) a whole sector a dim. The cache must hold exactly the
    bytes the store kernel's v leaves, every byte of every other slot untouched, and the output be
    the same bits: both read the same cache with the same kernel."""
    from nanoserve.runner.attention.decode_splits import longest_first
    from nanoserve.runner.attention.kv_layout import v_cache_copy
    from nanoserve.runner.attention.triton_decode import paged_decode

    heads, kv_heads, head_dim, dev = HEADS, KV_HEADS, DIM, "cuda"
    gen = torch.Generator(device=dev).manual_seed(batch + 7)
    seq_lens, blocks, tables, qkv, rope, slots = decode_step_inputs(batch, gen)
    caches = [torch.randn((blocks, BLOCK, kv_heads, head_dim), device=dev, generator=gen).to(FP8_DTYPE)
              for _ in range(2)]
    caches[1] = v_cache_copy(caches[1])
    want_k, want_v = (torch.empty_strided(c.shape, c.stride(), dtype=c.dtype, device=dev).copy_(c) for c in caches)
    positions = (seq_lens - 1).clamp_min(0).long()
    kw = dict(num_splits=splits) if splits else dict(split_keys=512, seq_order=longest_first(seq_lens))
    rope_args = (rope.cos, rope.sin, rope.q_weight, rope.k_weight, rope.eps)
    q = qkv_rope_store(positions, qkv, heads, kv_heads, head_dim, *rope_args, want_k, want_v, slots, 0.5, 2.0)
    want = paged_decode(q, want_k, want_v, seq_lens, tables, head_dim ** -0.5, 2048, k_scale=0.5, v_scale=2.0, **kw)
    q = qkv_rope_store(positions, qkv, heads, kv_heads, head_dim, *rope_args, *caches, slots, 0.5, 2.0, store_v=False)
    new_v = qkv[:, (heads + kv_heads) * head_dim:].unflatten(1, (kv_heads, head_dim))
    got = paged_decode(q, *caches, seq_lens, tables, head_dim ** -0.5, 2048, k_scale=0.5, v_scale=2.0,
                       new_v=new_v, **kw)
    torch.cuda.synchronize()
    assert torch.equal(caches[0].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), want_v.view(torch.uint8))
    assert torch.equal(got, want)
