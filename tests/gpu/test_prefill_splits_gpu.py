"""Split prefill programs (prefill_splits.py) on the GPU, at the engine's tiles (bf16, head dim 128,
128 x 128 tiles, parts of 256-key units): turns after long histories, one or two beside a decode
row, give the torch reference's output, and the unsplit kernel's within rounding, over a bf16
cache and an fp8 one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve.runner.attention.decode_splits import num_sms
from nanoserve.runner.attention.fp8 import quantize_fp8
from nanoserve.runner.attention.kv_layout import v_cache_copy
from nanoserve.runner.attention.prefill_splits import MAX_SLOTS, PrefillSplits, plan_splits, split_region_size, split_unit
from nanoserve.runner.attention.triton_kernels import store_kvcache
from nanoserve.runner.attention.triton_prefill import paged_prefill, prefill_tile_rows, prefill_tiles
from tests.gpu.test_attention_kernels import assert_close, make_step, reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("specs", [[(64, 4160)], [(500, 4600)], [(64, 2112), (100, 3000), (1, 700)]],
                         ids=["64-after-4k", "500-after-4k", "two-turns-and-a-decode-row"])
def test_split_prefill_matches_the_reference_and_the_unsplit_kernel(specs, fp8):
    kv_heads, group, head_dim, dtype = 8, 2, 128, torch.bfloat16
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=256, kv_heads=kv_heads, group=group,
                                                head_dim=head_dim, dtype=dtype, seed=5)
    scale = head_dim ** -0.5
    want, kc, vc = reference(q, k, v, k_cache, v_cache, meta, scale)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    scales = {}
    if fp8:
        k_cache, v_cache = quantize_fp8(k_cache, 0.05), v_cache_copy(quantize_fp8(v_cache, 0.05))
        scales = dict(k_scale=0.05, v_scale=0.05)
    block_m, block_q = prefill_tile_rows(kv_heads * group, kv_heads, head_dim, dtype, q.device)
    query_lens, seq_lens = [n for n, _ in specs], [s for _, s in specs]
    count = sum(-(-n // block_q) for n in query_lens if n > 1)
    tiles = np.full(count + MAX_SLOTS, -1, dtype=np.int32)
    prefill_tiles(query_lens, block_q, tiles[:count])
    run = lambda tiles, **kw: paged_prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,  # noqa: E731
                                            meta.block_tables, scale, meta.max_query_len, skip_decode_rows=True,
                                            tiles=torch.from_numpy(tiles).cuda(), **scales, **kw)
    whole = run(tiles[:count].copy())
    region = torch.zeros(split_region_size(), dtype=torch.int32)
    total = plan_splits(tiles, count, query_lens, np.asarray(seq_lens), block_q, split_unit(q.device), kv_heads,
                        num_sms(q.device), region.numpy())
    assert total > count
    splits = PrefillSplits.allocate(region.cuda(), kv_heads, block_m, head_dim)
    splits.acc.fill_(float("nan"))
    split = run(tiles[:total].copy(), splits=splits)
    starts = meta.query_start_loc.tolist()
    rows = [r for i, n in enumerate(query_lens) if n > 1 for r in range(starts[i], starts[i + 1])]
    torch.testing.assert_close(split[rows].float(), whole[rows].float(), rtol=2e-2, atol=2e-2)
    if not fp8:
        assert_close(split[rows], want[rows], dtype)
