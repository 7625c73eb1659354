"""Key splits of a small captured prefill step (prefill_splits.py): the plan covers each split
tile's keys once, in whole units, and the split kernel with its merge gives the unsplit output,
over a bf16-sized float32 cache and an fp8 one (Triton interpreter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve.runner.attention.fp8 import quantize_fp8
from nanoserve.runner.attention.kv_layout import v_cache_copy
from nanoserve.runner.attention.prefill_splits import (MAX_SLOTS, PLAN_SIZE, SEQ_SHIFT, SLOT_FIELD, SLOT_SHIFT,
                                                       TILE_FIELD, PrefillSplits, best_span, plan_splits, plan_views,
                                                       split_span, split_unit)
from nanoserve.runner.attention.triton_kernels import store_kvcache
from nanoserve.runner.attention.triton_prefill import paged_prefill, prefill_tile_rows, prefill_tiles


def plan(query_lens: list[int], seq_lens: list[int], block_q: int, unit: int, kv_heads: int, num_sms: int):
    """The step's split program list, its length and the plan's region, as the staging writes them,
    and the unsplit list."""
    count = sum(-(-n // block_q) for n in query_lens if n > 1)
    tiles = np.full(count + MAX_SLOTS, -1, dtype=np.int32)
    prefill_tiles(query_lens, block_q, tiles[:count])
    whole = tiles[:count].copy()
    region = np.zeros(PLAN_SIZE, dtype=np.int32)
    total = plan_splits(tiles, count, query_lens, np.asarray(seq_lens), block_q, unit, kv_heads, num_sms, region)
    return tiles, total, region, whole


def parts_by_tile(tiles: np.ndarray, total: int, region: np.ndarray) -> dict[tuple[int, int], list[tuple[int, int]]]:
    ranges = plan_views(region)[1]
    keys: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for entry in tiles[:total].tolist():
        slot = (entry >> SLOT_SHIFT) & SLOT_FIELD
        keys.setdefault((entry >> SEQ_SHIFT, entry & TILE_FIELD), []).append(tuple(ranges[slot - 1]) if slot else None)
    return keys


@pytest.mark.parametrize("query_lens, seq_lens, kv_heads", [
    ([64], [4160], 8),                        # a chunk after a long history
    ([512], [4608], 8),
    ([64], [64 + 40000], 8),                  # parts long enough for the slots
    ([300, 1, 200], [2300, 900, 2500], 4),    # prompts after their histories, a decode row between
])
def test_a_plan_covers_each_split_tiles_keys_once_in_whole_units(query_lens, seq_lens, kv_heads):
    block_q, unit, sms = 64, 256, 132
    tiles, total, region, _ = plan(query_lens, seq_lens, block_q, unit, kv_heads, sms)
    merges, ranges = plan_views(region)
    by_tile = parts_by_tile(tiles, total, region)
    assert sorted(by_tile) == sorted((s, t) for s, n in enumerate(query_lens) if n > 1
                                     for t in range(-(-n // block_q)))
    split = 0
    for (seq, tile), parts in by_tile.items():
        end = seq_lens[seq] - query_lens[seq] + min((tile + 1) * block_q, query_lens[seq])
        if parts == [None]:
            continue
        split += 1
        assert None not in parts and len(parts) > 1
        parts = sorted(parts)
        assert parts[0][0] == 0 and parts[-1][1] == end
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert all(first % unit == 0 for first, _ in parts)
        row = [m for m in merges.tolist() if m[0] == (seq << SEQ_SHIFT | tile)]
        assert row and row[0][2] == len(parts)
    assert split == sum(m[0] >= 0 for m in merges.tolist()) > 0
    assert total * kv_heads <= sms   # one wave
    lengths = []   # the list runs longest programs first
    for entry in tiles[:total].tolist():
        seq, tile, slot = entry >> SEQ_SHIFT, entry & TILE_FIELD, (entry >> SLOT_SHIFT) & SLOT_FIELD
        end = seq_lens[seq] - query_lens[seq] + min((tile + 1) * block_q, query_lens[seq])
        lengths.append(int(ranges[slot - 1][1] - ranges[slot - 1][0]) if slot else end)
    assert lengths == sorted(lengths, reverse=True)


@pytest.mark.parametrize("query_lens, seq_lens", [([1024], [1024]), ([512], [512]), ([4096], [4096])],
                         ids=["lone-1k", "lone-512", "fills-the-gpu"])
def test_a_lone_fresh_prompt_is_not_split(query_lens, seq_lens):
    # measured: splitting a lone 512- or 1k-token prompt lost time on an H100 (split_span's note)
    tiles, total, region, _ = plan(query_lens, seq_lens, 64, 256, 8, 132)
    assert total == -(-query_lens[0] // 64) and (plan_views(region)[0] == -1).all()
    assert all((entry >> SLOT_SHIFT) & SLOT_FIELD == 0 for entry in tiles[:total].tolist())


def test_an_entry_holds_the_largest_bucket_at_one_token_a_tile_and_every_graph_sequence():
    from nanoserve.runner.prefill_graph import LARGEST_BUCKET, MAX_GRAPH_SEQS
    out = np.empty(LARGEST_BUCKET + 1, dtype=np.int32)
    assert prefill_tiles([LARGEST_BUCKET], 1, out) == LARGEST_BUCKET   # a query group of 128 heads
    assert (out[:LARGEST_BUCKET] & TILE_FIELD).tolist() == list(range(LARGEST_BUCKET)) and out[-1] == -1
    out = np.empty(MAX_GRAPH_SEQS, dtype=np.int32)
    assert prefill_tiles([2] * MAX_GRAPH_SEQS, 64, out) == MAX_GRAPH_SEQS
    assert (out >> SEQ_SHIFT).tolist() == list(range(MAX_GRAPH_SEQS)) and (out & TILE_FIELD == 0).all()
    with pytest.raises(ValueError, match="more tiles than an entry holds"):
        prefill_tiles([TILE_FIELD + 2], 1, np.empty(TILE_FIELD + 2, dtype=np.int32))


def test_the_shortcut_refuses_only_steps_the_estimate_would_not_split():
    rng = np.random.default_rng(3)
    refused = split = 0
    for _ in range(400):
        tiles = int(rng.integers(1, 17))
        history = int(rng.choice([0, 0, int(rng.integers(1, 9000))]))
        ends = history + np.minimum(np.arange(1, tiles + 1) * 64, int(rng.integers(2, tiles * 64 + 1)))
        kv_heads = int(rng.choice([1, 2, 4, 8]))
        full = best_span(ends, 256, kv_heads, 132)
        assert split_span(ends, 256, kv_heads, 132) == full
        refused += int(ends.sum()) * kv_heads / 132 + 512 >= int(ends.max())
        split += full > 0
    assert refused > 50 and split > 50   # both ways were taken


def whole_and_split(q, k_cache, v_cache, meta, scale: float, num_sms: int, **scales):
    """The prefill kernel's output over `meta`'s step whole, then with its plan's splits and merge
    (asserting some tile was split), and the rows of its prompts (decode rows are not the kernel's)."""
    kv_heads, head_dim = k_cache.shape[2], q.shape[2]
    block_m, block_q = prefill_tile_rows(q.shape[1], kv_heads, head_dim, q.dtype, q.device)
    query_lens = meta.query_lens_host
    tiles, total, region, unsplit = plan(query_lens, meta.seq_lens_host, block_q, split_unit(q.device), kv_heads,
                                         num_sms)
    assert total > len(unsplit)   # some tile was split
    run = lambda tiles, **kw: paged_prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,  # noqa: E731
                                            meta.block_tables, scale, meta.max_query_len, skip_decode_rows=True,
                                            tiles=torch.from_numpy(tiles).to(q.device), **scales, **kw)
    whole = run(unsplit)
    splits = PrefillSplits.allocate(torch.from_numpy(region).to(q.device), kv_heads, block_m, head_dim)
    splits.acc.fill_(float("nan"))   # a part's slot must be written before the merge reads it
    split = run(tiles[:total].copy(), splits=splits)
    starts = meta.query_start_loc.tolist()
    rows = [r for i, n in enumerate(query_lens) if n > 1 for r in range(starts[i], starts[i + 1])]
    return whole, split, rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's check; tests/gpu runs the kernels on the GPU")
@pytest.mark.parametrize("fp8", [False, True], ids=["float32-cache", "fp8-cache"])
@pytest.mark.parametrize("specs", [
    [(100, 100)],                      # a lone prompt
    [(9, 170)],                        # a chunk after its history
    [(40, 40), (1, 77), (23, 130)],    # prompts beside a decode row (the decode kernel's)
], ids=["lone", "after-history", "several"])
def test_split_tiles_give_the_unsplit_output(specs, fp8):
    # imported here: that module skips itself where there is a GPU, and tests/gpu imports this one
    from tests.runner.test_triton_attention import make_step
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=16, kv_heads=2, group=2, head_dim=64,
                                                dtype=torch.float32, seed=90)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    scales = {}
    if fp8:
        # as the engine keeps an fp8 cache: V along tokens (kv_layout.py), read a whole block tile at a time
        k_cache, v_cache = quantize_fp8(k_cache, 0.5), v_cache_copy(quantize_fp8(v_cache, 0.25))
        scales = dict(k_scale=0.5, v_scale=0.25)
    # SMs enough for every part in one wave: the interpreter's few would split nothing
    whole, split, rows = whole_and_split(q, k_cache, v_cache, meta, 0.125, 256, **scales)
    torch.testing.assert_close(split[rows], whole[rows], rtol=1e-5, atol=1e-5)
