"""The fused q/k norm + rotary + KV store kernel on the GPU against the unfused path (ops.qkv_rope,
then the torch store) at the Qwen3-0.6B attention shape, bf16, into bf16 and fp8 caches."""

from __future__ import annotations

import pytest
import torch

from nanoserve.runner.attention.fp8 import FP8_DTYPE
from nanoserve.runner.attention.torch_backend import store_kv
from nanoserve.runner.attention.triton_rope_store import qkv_rope_store
from nanoserve.runner.layers.ops import qkv_rope

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
