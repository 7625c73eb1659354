"""Split prefill programs (prefill_splits.py) on the GPU, at the engine's tiles (bf16, head dim 128,
128 x 128 tiles, parts of 256-key units): turns after long histories, one or two beside a decode
row, give the torch reference's output, and the unsplit kernel's within rounding, over a bf16
cache and an fp8 one."""

from __future__ import annotations

import pytest
import torch

from nanoserve.runner.attention.decode_splits import num_sms
from nanoserve.runner.attention.fp8 import quantize_fp8
from nanoserve.runner.attention.kv_layout import v_cache_copy
from nanoserve.runner.attention.triton_kernels import store_kvcache
from tests.gpu.test_attention_kernels import assert_close, make_step, reference
from tests.runner.test_prefill_splits import whole_and_split

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("specs", [[(64, 4160)], [(500, 4600)], [(64, 2112), (100, 3000), (1, 700)]],
                         ids=["64-after-4k", "500-after-4k", "two-turns-and-a-decode-row"])
def test_split_prefill_matches_the_reference_and_the_unsplit_kernel(specs, fp8):
    head_dim, dtype = 128, torch.bfloat16
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=256, kv_heads=8, group=2, head_dim=head_dim,
                                                dtype=dtype, seed=5)
    scale = head_dim ** -0.5
    want, kc, vc = reference(q, k, v, k_cache, v_cache, meta, scale)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    scales = {}
    if fp8:
        k_cache, v_cache = quantize_fp8(k_cache, 0.05), v_cache_copy(quantize_fp8(v_cache, 0.05))
        scales = dict(k_scale=0.05, v_scale=0.05)
    whole, split, rows = whole_and_split(q, k_cache, v_cache, meta, scale, num_sms(q.device), **scales)
    torch.testing.assert_close(split[rows].float(), whole[rows].float(), rtol=2e-2, atol=2e-2)
    if not fp8:
        assert_close(split[rows], want[rows], dtype)
