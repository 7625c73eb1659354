"""Split decode under the Triton interpreter: splits past a sequence's end, merge programs of
several heads, fixed-size splits, and contexts within one split written without a merge. The
workspace torch.empty hands out is NaN, so a partial the merge reads but no split wrote shows."""

from __future__ import annotations

import pytest
import torch

from nanoserve.runner.attention.decode_splits import longest_first
from nanoserve.runner.attention.triton_decode import paged_decode
from nanoserve.runner.attention.triton_kernels import store_kvcache
from tests.runner.test_triton_attention import NanWorkspace, assert_close, make_step, reference

if torch.cuda.is_available():
    pytest.skip("the GPU versions of these checks live in tests/gpu", allow_module_level=True)


def test_decode_splits_past_a_sequence_end_are_left_out_of_the_merge(monkeypatch) -> None:
    # 8 splits of a 20-key context: most splits are empty, write nothing, and must not be merged
    import nanoserve.runner.attention.triton_decode as triton_decode
    monkeypatch.setattr(triton_decode, "torch", NanWorkspace())
    q, k, v, k_cache, v_cache, meta = make_step([(1, 20), (1, 0), (1, 3)], block_size=16, kv_heads=1,
                                                group=4, head_dim=64, dtype=torch.float32, seed=7)
    ref_out, _, _ = reference(q, k, v, k_cache, v_cache, meta, 0.125)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.125,
                       max_seq_len=4096, num_splits=8)
    assert (out[1] == 0).all(), "a padding row must come back as zeros"
    assert_close(out, ref_out, torch.float32)


@pytest.mark.parametrize("tile", [64 * 4 * 64, 64 * 4 * 2, 64 * 4])
def test_merge_programs_of_several_heads_cover_every_head_once(tile, monkeypatch) -> None:
    """A merge program takes as many heads as its tile holds at the split width: 6 heads in one
    program, in programs of 2, or one at a time, the last program partly past the heads."""
    import nanoserve.runner.attention.triton_decode as triton_decode
    monkeypatch.setattr(triton_decode, "torch", NanWorkspace())
    monkeypatch.setattr(triton_decode, "MERGE_TILE", tile)
    assert triton_decode.merge_heads_per_program(6, 4, 64) == {64 * 4 * 64: 8, 64 * 4 * 2: 2, 64 * 4: 1}[tile]
    q, k, v, k_cache, v_cache, meta = make_step([(1, 50), (1, 0), (1, 7), (1, 33)], block_size=16, kv_heads=3,
                                                group=2, head_dim=64, dtype=torch.float32, seed=17)
    ref_out, _, _ = reference(q, k, v, k_cache, v_cache, meta, 0.125)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.125, max_seq_len=4096,
                       num_splits=4)
    assert (out[1] == 0).all(), "a padding row must come back as zeros"
    assert_close(out, ref_out, torch.float32)


class _RecordingNanWorkspace(NanWorkspace):
    """NanWorkspace, keeping what torch.empty handed out: the split partials."""

    def __init__(self) -> None:
        self.made: list[torch.Tensor] = []

    def empty(self, *shape, **kw):
        made = NanWorkspace.empty(*shape, **kw)
        self.made.append(made)
        return made


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_a_context_within_one_split_is_written_directly_with_the_unsplit_bits(kv_dtype, monkeypatch) -> None:
    """Splits of 16 keys: the 7- and 16-key contexts fit the first, write no partial and skip the
    merge, with the bits of a launch without splits; the 40-key one is merged."""
    import nanoserve.runner.attention.triton_decode as triton_decode
    workspace = _RecordingNanWorkspace()
    monkeypatch.setattr(triton_decode, "torch", workspace)
    q, k, v, k_cache, v_cache, meta = make_step([(1, 40), (1, 0), (1, 7), (1, 16)], block_size=16, kv_heads=2,
                                                group=2, head_dim=64, dtype=torch.float32, seed=23)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    args = (q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.125, 4096)
    config = dict(BLOCK_N=16)
    split = paged_decode(*args, split_keys=16, config=config, out=torch.full_like(q, float("nan")))
    whole = paged_decode(*args, num_splits=1, config=config)
    part_acc = workspace.made[0]   # [batch, q heads, splits, dim]
    assert part_acc.shape[2] > 1
    assert part_acc[2:].isnan().all(), "a context within one split wrote a partial"
    assert not part_acc[0, :, :3].isnan().any()
    assert torch.equal(split[2:], whole[2:])
    assert (split[1] == 0).all()
    assert_close(split[0], whole[0], torch.float32)


# 16 splits sized for max_seq_len, most of them past every context's end (as at 4,096 keys, where the
# 64 splits, four times the programs under the interpreter, merge no differently), 2, and 5 of 48 keys
@pytest.mark.parametrize("split_keys,max_seq_len", [(16, 256), (32, 512), (16, 32), (40, 200)])
def test_decode_with_fixed_size_splits_matches_reference(split_keys, max_seq_len, monkeypatch) -> None:
    """Splits of split_keys keys, the last taking the rest: also when a context outgrows the split
    count sized for max_seq_len (70 keys over 2 splits of 16)."""
    import nanoserve.runner.attention.triton_decode as triton_decode
    monkeypatch.setattr(triton_decode, "torch", NanWorkspace())
    specs = [(1, 70), (1, 0), (1, 3), (1, 41), (1, 16), (1, 17)]
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=16, kv_heads=2, group=2, head_dim=64,
                                                dtype=torch.float32, seed=split_keys + max_seq_len)
    ref_out, _, _ = reference(q, k, v, k_cache, v_cache, meta, 0.125)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.125, max_seq_len,
                       split_keys=split_keys)
    assert (out[1] == 0).all(), "a padding row must come back as zeros"
    assert_close(out, ref_out, torch.float32)
    ordered = paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.125, max_seq_len,
                           split_keys=split_keys, seq_order=longest_first(meta.seq_lens))
    assert torch.equal(ordered, out)
