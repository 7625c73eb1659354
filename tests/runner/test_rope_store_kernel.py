"""The fused q/k norm + rotary + KV store kernel against the unfused torch path (ops.qkv_rope, then
the torch backend's store), under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from nanoserve.runner.attention.fp8 import FP8_DTYPE, quantize_fp8
from nanoserve.runner.attention.kv_layout import v_cache_view
from nanoserve.runner.attention.torch_backend import store_kv
from nanoserve.runner.attention.triton_rope_store import qkv_rope_store
from nanoserve.runner.layers.ops import qkv_rope

if torch.cuda.is_available():
    pytest.skip("the GPU version of this check lives in tests/gpu", allow_module_level=True)

TOL = {torch.float32: 1e-6, torch.float16: 2e-3}


def rotary_tables(head_dim: int, positions: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(positions).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8 V along tokens"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (6, 3, 32)])
def test_fused_kernel_matches_qkv_rope_then_store(dtype, qk_norm, kv_cache_dtype, heads, kv_heads,
                                                  head_dim) -> None:
    gen = torch.Generator().manual_seed(heads * head_dim + qk_norm)
    tokens, block_size, num_blocks = 7, 16, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    slots = torch.tensor([5, -1, 63, 16, 17, -1, 0])   # -1: padding, writes nothing
    cos, sin = rotary_tables(head_dim)
    weights = ((1 + 0.3 * torch.randn(2, head_dim, generator=gen)).to(dtype).unbind(0)
               if qk_norm else (None, None))
    fp8 = kv_cache_dtype.startswith("fp8")
    k_scale, v_scale = (0.5, 2.0) if fp8 else (1.0, 1.0)
    cache_dtype = FP8_DTYPE if fp8 else dtype
    caches = [torch.full((num_blocks, block_size, kv_heads, head_dim), 0.25).to(cache_dtype)
              for _ in range(4)]
    if kv_cache_dtype == "fp8 V along tokens":   # the engine's layout of an fp8 cache's V
        caches[1], caches[3] = (v_cache_view(c, fp8=True) for c in (caches[1], caches[3]))

    q_ref, k_ref, v_ref = qkv_rope(positions, qkv, heads, kv_heads, head_dim, cos, sin, *weights,
                                   1e-6)
    store_kv(k_ref, v_ref, caches[0], caches[1], slots, k_scale, v_scale)
    q = qkv_rope_store(positions, qkv, heads, kv_heads, head_dim, cos, sin, *weights, 1e-6,
                       caches[2], caches[3], slots, k_scale, v_scale)

    torch.testing.assert_close(q, q_ref, rtol=TOL[dtype], atol=TOL[dtype])
    for got, want, scale in ((caches[2], caches[0], k_scale), (caches[3], caches[1], v_scale)):
        got, want = got.float() * scale, want.float() * scale
        if fp8:
            # the fused kernel rounds k once (float32 -> e4m3), the unfused path twice (via
            # `dtype`): at most one e4m3 step apart, and rarely that
            step = quantize_fp8(want.abs() * 2**-3, 1.0).float().clamp_min(2**-9 * scale)
            assert ((got - want).abs() <= step).all()
            assert (got != want).float().mean() < 0.01
        else:
            torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    for cache in caches[2:]:
        assert (cache.float().reshape(-1, kv_heads, head_dim)[untouched] == 0.25).all()
