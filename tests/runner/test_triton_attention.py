"""Triton attention kernels against the torch reference, under the Triton interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported). Shapes stay small: the
interpreter runs every program in numpy."""

from __future__ import annotations

import pytest
import torch

from nanoserve.runner.attention import TorchBackend, select_backend
from nanoserve.runner.attention.decode_splits import MIN_TOKENS_PER_SPLIT, longest_first, num_decode_splits
from nanoserve.runner.attention.triton_decode import paged_decode
from nanoserve.runner.attention.triton_kernels import TritonBackend, store_kvcache
from nanoserve.runner.attention.triton_prefill import paged_prefill
from nanoserve.runner.batch import AttentionMetadata

if torch.cuda.is_available():
    pytest.skip("the GPU versions of these checks live in tests/gpu", allow_module_level=True)

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}
POISON = 1234.5


def make_step(specs: list[tuple[int, int]], *, block_size: int, kv_heads: int, group: int,
              head_dim: int, dtype: torch.dtype, seed: int, spare_blocks: int = 3):
    """A step of sequences given as (q_len, seq_len): seq_len - q_len keys of history already in
    a random cache, q_len new tokens to store and attend. seq_len 0 is a padding row. Physical
    blocks are shuffled so that only correct block-table indexing can pass."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for _, s in specs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(max(blocks_per_seq), 1) + 1   # one -1 column past every sequence's end
    block_tables = torch.full((len(specs), max_blocks), -1, dtype=torch.int32)
    slots, used = [], 0
    for i, ((q_len, seq_len), n) in enumerate(zip(specs, blocks_per_seq)):
        table = perm[used:used + n]
        used += n
        block_tables[i, :n] = torch.tensor(table, dtype=torch.int32)
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size
                         if seq_len else -1)
    num_tokens = sum(q for q, _ in specs)
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    q = torch.randn(num_tokens, kv_heads * group, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    q_lens = [q for q, _ in specs]
    seq_lens = [s for _, s in specs]
    # seq_lens and block tables are strided views of one buffer: the kernels must not assume more
    lens_and_tables = torch.cat([torch.tensor(seq_lens, dtype=torch.int32)[:, None],
                                 block_tables], dim=1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64).repeat_interleave(2)[::2],  # strided
        query_start_loc=torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
        seq_lens=lens_and_tables[:, 0],
        block_tables=lens_and_tables[:, 1:],
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=q_lens,
        seq_lens_host=seq_lens,
    )
    return q, k, v, k_cache, v_cache, meta


def reference(q, k, v, k_cache, v_cache, meta, scale):
    """The torch backend in float32 on copies of the caches: (out, k_cache, v_cache)."""
    kc, vc = k_cache.float().clone(), v_cache.float().clone()
    out = TorchBackend().forward(q.float(), k.float(), v.float(), kc, vc, meta, scale)
    return out, kc, vc


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any()
    err = (actual.float() - expected).norm() / expected.norm().clamp_min(1e-6)
    assert err < TOL[dtype], f"relative error {err:.2e} over {TOL[dtype]:.0e}"


class NanWorkspace:
    """torch, except that torch.empty hands out NaN: a partial the merge reads but no split wrote shows."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, **kw):
        return torch.full(shape, float("nan"), **kw)


def test_store_writes_each_token_to_its_slot_and_skips_padding() -> None:
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim = 4, 16, 3, 64   # 3 heads: a masked head tile
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), POISON)
    v_cache = torch.full_like(k_cache, POISON)
    slots = torch.tensor([5, -1, 63, 16, -1, 0], dtype=torch.int64).repeat_interleave(2)[1::2]
    # k, v as strided views of one packed projection, as the model produces them
    kv = torch.randn(len(slots), 2, kv_heads, head_dim)
    k, v = kv[:, 0], kv[:, 1]
    store_kvcache(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    written = slots[slots >= 0]
    torch.testing.assert_close(flat_k[written], k[slots >= 0], rtol=0, atol=0)
    torch.testing.assert_close(flat_v[written], v[slots >= 0], rtol=0, atol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[written] = False
    assert (flat_k[untouched] == POISON).all() and (flat_v[untouched] == POISON).all()


DECODE_CASES = [
    # dtype, block_size, head_dim, group, seed
    (torch.float32, 16, 64, 2, 1),
    (torch.float16, 16, 64, 4, 2),
    (torch.float32, 32, 64, 1, 3),
    (torch.float16, 32, 128, 2, 4),
]


@pytest.mark.parametrize("dtype,block_size,head_dim,group,seed", DECODE_CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads_fast", [True, False])   # the launch grid: a sequence's kv heads side by side, or not
def test_decode_matches_reference_with_gqa_split_k_and_padding(
        dtype, block_size, head_dim, group, seed, num_splits, heads_fast) -> None:
    torch.manual_seed(seed)
    # a padding row (seq_len 0, slot -1) sits between real rows; one row fits in one tile
    specs = [(1, 70), (1, 0), (1, 33), (1, 5)]
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=block_size, kv_heads=2,
                                                group=group, head_dim=head_dim, dtype=dtype,
                                                seed=seed * 10 + num_splits)
    scale = head_dim ** -0.5
    ref_out, ref_k, ref_v = reference(q, k, v, k_cache, v_cache, meta, scale)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale,
                       meta.max_seq_len, num_splits=num_splits, config=dict(HEADS_FAST=heads_fast))
    assert (out[1] == 0).all(), "a padding row must come back as zeros"
    assert_close(out, ref_out, dtype)
    assert torch.equal(k_cache.float(), ref_k) and torch.equal(v_cache.float(), ref_v)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("split", [dict(num_splits=1), dict(num_splits=3), dict(split_keys=32)])
def test_decode_reading_each_tiles_block_ahead_gives_the_same_bits(kv_dtype, split) -> None:
    """Each tile's block read as one index a tile ahead: the same bits as reading the table per key,
    over contexts that end mid-tile, on a tile bound, in the first tile, not at all (padding), and
    across blocks of several tiles each (block 32, tiles of 16 keys)."""
    specs = [(1, 70), (1, 0), (1, 33), (1, 5), (1, 64), (1, 16), (1, 17)]
    q, _, _, k_cache, v_cache, meta = make_step(specs, block_size=32, kv_heads=2, group=2, head_dim=64,
                                                dtype=torch.float32, seed=7)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    run = lambda config: paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.125, 96,
                                      config=config, **split)
    want = run(dict(BLOCK_AHEAD=False))
    assert want[1].eq(0).all() and want.abs().sum() > 0
    assert torch.equal(run(dict(BLOCK_AHEAD=True)), want)
    # the guard on the block read ahead is a tile width against the block size, whatever the splits:
    # a wide tile read as one block would misread the 33-, 64- and 70-key contexts in any of them
    if split == dict(num_splits=3):
        assert torch.equal(run(dict(BLOCK_AHEAD=True, BLOCK_N=64)), run(dict(BLOCK_AHEAD=False, BLOCK_N=64))), \
            "tiles wider than a block read the table per key"


PREFILL_CASES = [
    # dtype, block_size, head_dim, group, seed
    (torch.float32, 16, 64, 2, 11),
    (torch.float16, 16, 64, 1, 12),
    (torch.float16, 32, 64, 4, 13),
    (torch.float32, 32, 128, 2, 14),
]


@pytest.mark.parametrize("dtype,block_size,head_dim,group,seed", PREFILL_CASES)
def test_prefill_matches_reference_with_prefix_history(
        dtype, block_size, head_dim, group, seed) -> None:
    torch.manual_seed(seed)
    # a fresh prompt, a prefix hit (history 40), a chunk after a chunk, a decode row, and a chunk
    # whose first query sits on the last key of a tile (history 15): the rows of its first query
    # tile see no key of the next tile, the first one past the unmasked ones
    specs = [(23, 23), (9, 49), (17, 50), (1, 38), (20, 35)]
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=block_size, kv_heads=2,
                                                group=group, head_dim=head_dim, dtype=dtype,
                                                seed=seed)
    scale = head_dim ** -0.5
    ref_out, ref_k, ref_v = reference(q, k, v, k_cache, v_cache, meta, scale)
    out = TritonBackend().forward(q, k, v, k_cache, v_cache, meta, scale)
    assert_close(out, ref_out, dtype)
    assert torch.equal(k_cache.float(), ref_k) and torch.equal(v_cache.float(), ref_v)


@pytest.mark.parametrize("last_tiles_first", [False, True])
def test_prefill_tile_configs_match_reference(last_tiles_first) -> None:
    """The overrides a tile sweep times (bench/attention_kernels.py --prefill-sweep) compute the same attention."""
    specs = [(40, 40), (9, 49), (1, 38), (20, 35)]
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=16, kv_heads=2, group=2, head_dim=64,
                                                dtype=torch.float32, seed=21)
    scale = 64 ** -0.5
    # the caches as the reference stored the keys: store_kvcache's bits (tested above), without its
    # program a token under the interpreter
    ref_out, k_cache, v_cache = reference(q, k, v, k_cache, v_cache, meta, scale)
    config = dict(BLOCK_M=32, BLOCK_N=16, num_warps=1, num_stages=1, LAST_TILES_FIRST=last_tiles_first)
    out = paged_prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                        meta.max_query_len, config=config)
    assert_close(out, ref_out, torch.float32)


def test_backend_decode_path_matches_reference() -> None:
    q, k, v, k_cache, v_cache, meta = make_step([(1, 40), (1, 0), (1, 17)], block_size=16,
                                                kv_heads=2, group=2, head_dim=64,
                                                dtype=torch.float32, seed=21)
    assert meta.decode_only
    ref_out, _, _ = reference(q, k, v, k_cache, v_cache, meta, 0.125)
    out = TritonBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    assert_close(out, ref_out, torch.float32)


def test_split_count_fills_the_gpu_only_when_the_batch_cannot() -> None:
    sms = 132
    assert num_decode_splits(batch=256, kv_heads=8, max_seq_len=32768, num_sms=sms) == 1
    assert num_decode_splits(batch=1, kv_heads=8, max_seq_len=32768, num_sms=sms) > 16
    # no split shorter than MIN_TOKENS_PER_SPLIT keys: a lone sequence of 4 times that takes 4
    assert num_decode_splits(batch=1, kv_heads=8, max_seq_len=4 * MIN_TOKENS_PER_SPLIT, num_sms=sms) == 4
    assert num_decode_splits(batch=1, kv_heads=8, max_seq_len=MIN_TOKENS_PER_SPLIT, num_sms=sms) == 1
    assert num_decode_splits(batch=1, kv_heads=8, max_seq_len=100, num_sms=sms) == 1


def test_select_backend_picks_torch_on_cpu_and_explains_refusals(monkeypatch) -> None:
    assert select_backend("auto", "cpu", 16).name == "torch"
    assert select_backend("torch", "cpu", 16).name == "torch"
    assert select_backend("triton", "cpu", 16, dtype=torch.float32).name == "triton"   # the interpreter is on
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("xformers", "cpu", 16)
    with pytest.raises(ValueError, match="power-of-two block_size"):
        select_backend("triton", "cpu", 24)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("triton", "cpu", 16)
    with pytest.raises(ValueError, match="flash_attn"):
        select_backend("flash_attn", "cpu", 256)


def test_select_backend_keeps_flash_attn_to_half_precision(monkeypatch) -> None:
    """flash-attn computes in fp16/bf16 only: auto passes it over for a float32 model, and
    asking for it by name with float32 is refused up front instead of failing at the first prefill."""
    import nanoserve.runner.attention as attention
    monkeypatch.setattr(attention, "_flash_attn_imports", lambda: True)
    assert select_backend("auto", "cuda", 256, dtype=torch.float32).name == "triton"
    with pytest.raises(ValueError, match="float16 or bfloat16, not float32"):
        select_backend("flash_attn", "cuda", 256, dtype=torch.float32)


@pytest.mark.parametrize("group,num_splits", [(2, 1), (4, 3), (1, 2)])
def test_longest_first_order_gives_the_same_bits(group, num_splits) -> None:
    """seq_order changes only when each row's programs start: every row's output is the one it
    gets in row order, bit for bit, the padding row's included."""
    specs = [(1, 70), (1, 0), (1, 3), (1, 41), (1, 300)]
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=16, kv_heads=2, group=group, head_dim=64,
                                                dtype=torch.float32, seed=40 + num_splits)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    order = longest_first(meta.seq_lens)
    assert order.tolist() == [4, 0, 3, 2, 1]
    run = lambda **kw: paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 64 ** -0.5,
                                    meta.max_seq_len, num_splits=num_splits, **kw)
    in_rows, ordered = run(), run(seq_order=order)
    assert torch.equal(ordered, in_rows)
    assert (ordered[1] == 0).all(), "a padding row must come back as zeros"
    with pytest.raises(ValueError, match="seq_order"):
        run(seq_order=order.long())


def test_fixed_size_splits_apply_over_an_fp8_cache_or_where_asked_and_only_where_the_batch_fills_the_gpu(monkeypatch) -> None:
    from nanoserve.runner.attention.decode_splits import engine_split_keys
    cpu = torch.device("cpu")   # 4 SMs under the interpreter: batch 2 x 8 kv heads fills them
    from nanoserve.runner.attention.decode_splits import _split_keys_asked
    monkeypatch.delenv("NANOSERVE_DECODE_SPLIT_KEYS", raising=False)
    _split_keys_asked.cache_clear()
    assert engine_split_keys(64, 8, 4096, cpu) is None
    assert engine_split_keys(64, 8, 4096, cpu, fp8_cache=True) == 1024   # an fp8 cache's default
    assert engine_split_keys(1, 1, 4096, cpu, fp8_cache=True) is None   # even splits already spread a small batch
    monkeypatch.setenv("NANOSERVE_DECODE_SPLIT_KEYS", "256")
    _split_keys_asked.cache_clear()
    assert engine_split_keys(64, 8, 4096, cpu) == 256
    assert engine_split_keys(1, 1, 4096, cpu) is None
    monkeypatch.setenv("NANOSERVE_DECODE_SPLIT_KEYS", "0")
    _split_keys_asked.cache_clear()
    assert engine_split_keys(64, 8, 4096, cpu, fp8_cache=True) is None
    _split_keys_asked.cache_clear()


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads_fast", [True, False])
def test_decode_over_a_mixed_steps_packed_rows_fills_only_its_decode_rows(num_splits, heads_fast) -> None:
    specs = [(1, 38), (23, 23), (1, 0), (9, 49), (1, 70), (1, 5)]   # a padding row among them
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=16, kv_heads=2, group=2, head_dim=64,
                                                dtype=torch.float32, seed=50 + num_splits)
    ref_out, _, _ = reference(q, k, v, k_cache, v_cache, meta, 0.125)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.full_like(q, POISON)
    paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.125, meta.max_seq_len,
                 num_splits=num_splits, query_start_loc=meta.query_start_loc, out=out,
                 config=dict(HEADS_FAST=heads_fast))
    starts = meta.query_start_loc.tolist()
    decode_rows = [starts[i] for i, (q_len, seq_len) in enumerate(specs) if q_len == 1 and seq_len > 0]
    prompt_rows = [r for i, (q_len, _) in enumerate(specs) if q_len > 1 for r in range(starts[i], starts[i + 1])]
    assert_close(out[decode_rows], ref_out[decode_rows], torch.float32)
    assert (out[starts[2]] == 0).all(), "a padding row must come back as zeros"
    assert (out[prompt_rows] == POISON).all(), "a prompt's rows are the prefill kernel's"


def test_a_mixed_step_sends_its_decode_rows_to_the_decode_kernel(monkeypatch) -> None:
    import nanoserve.runner.attention.triton_decode as triton_decode
    import nanoserve.runner.attention.triton_kernels as triton_kernels
    specs = [(1, 38), (23, 23), (9, 49), (1, 70), (1, 5), (1, 17)]
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=16, kv_heads=2, group=2, head_dim=64,
                                                dtype=torch.float32, seed=60)
    ref_out, ref_k, ref_v = reference(q, k, v, k_cache, v_cache, meta, 0.125)
    outputs = {}
    for threshold in (100, 2):   # one prefill launch, then decode rows apart
        monkeypatch.setattr(triton_kernels, "MIXED_MIN_DECODE_ROWS", threshold)
        calls = []
        monkeypatch.setattr(triton_kernels, "paged_decode",
                            lambda *a, **kw: calls.append(kw) or triton_decode.paged_decode(*a, **kw))
        kc, vc = k_cache.clone(), v_cache.clone()
        outputs[threshold] = TritonBackend().forward(q, k, v, kc, vc, meta, 0.125)
        assert len(calls) == (threshold == 2)
        assert_close(outputs[threshold], ref_out, torch.float32)
        assert torch.equal(kc.float(), ref_k) and torch.equal(vc.float(), ref_v)


def test_prefill_leaves_a_mixed_steps_decode_rows_to_the_decode_kernel(monkeypatch) -> None:
    import nanoserve.runner.attention.triton_prefill as triton_prefill

    class NanOutput(NanWorkspace):
        @staticmethod
        def empty_like(t, **kw):
            return torch.full_like(t, float("nan"), **kw)

    monkeypatch.setattr(triton_prefill, "torch", NanOutput())
    specs = [(1, 38), (23, 23), (9, 49), (1, 5)]
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=16, kv_heads=2, group=2, head_dim=64,
                                                dtype=torch.float32, seed=70)
    ref_out, k_cache, v_cache = reference(q, k, v, k_cache, v_cache, meta, 0.125)   # float32: the caches' dtype
    out = paged_prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125,
                        meta.max_query_len, skip_decode_rows=True)
    starts = meta.query_start_loc.tolist()
    prompt_rows = list(range(starts[1], starts[3]))
    assert out[[starts[0], starts[3]]].isnan().all(), "decode rows are the decode kernel's"
    assert_close(out[prompt_rows], ref_out[prompt_rows], torch.float32)


def test_prefill_over_a_staged_tile_list_gives_the_same_bits_as_over_the_grid() -> None:
    import numpy as np

    from nanoserve.runner.attention.prefill_splits import SEQ_SHIFT, TILE_FIELD
    from nanoserve.runner.attention.triton_prefill import prefill_block_q, prefill_tiles
    specs = [(1, 38), (23, 23), (9, 49), (1, 5), (40, 40)]
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=16, kv_heads=2, group=2, head_dim=64,
                                                dtype=torch.float32, seed=80)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    block_q = prefill_block_q(4, 2, 64, torch.float32, q.device)
    tiles = np.empty(sum(n for n, _ in specs) // block_q + len(specs), dtype=np.int32)
    prefill_tiles([n for n, _ in specs], block_q, tiles)
    real = tiles[tiles >= 0]
    assert len(real) == sum(-(-n // block_q) for n, _ in specs if n > 1) and (tiles[len(real):] == -1).all()
    run = lambda **kw: paged_prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                     0.125, meta.max_query_len, skip_decode_rows=True, **kw)
    over_grid, over_tiles = run(), run(tiles=torch.from_numpy(tiles))
    starts = meta.query_start_loc.tolist()
    prompt_rows = [r for i, (n, _) in enumerate(specs) if n > 1 for r in range(starts[i], starts[i + 1])]
    assert torch.equal(over_tiles[prompt_rows], over_grid[prompt_rows])
    # any order of the list, a tile's kv heads launched side by side or head by head: the same bits
    shuffled = torch.from_numpy(np.concatenate([np.random.default_rng(3).permutation(real), tiles[len(real):]]))
    for heads_fast in (True, False):
        out = run(tiles=shuffled, config={"HEADS_FAST": heads_fast})
        assert torch.equal(out[prompt_rows], over_grid[prompt_rows])
    # listed longest first: the same programs, by the keys each reads
    longest = np.empty_like(tiles)
    seq_lens = meta.seq_lens.numpy().astype(np.int64)
    assert prefill_tiles([n for n, _ in specs], block_q, longest, seq_lens) == len(real)
    assert sorted(longest[:len(real)].tolist()) == sorted(real.tolist())
    seqs, tile = longest[:len(real)] >> SEQ_SHIFT, longest[:len(real)] & TILE_FIELD
    lens = np.array([n for n, _ in specs])[seqs]
    ends = seq_lens[seqs] - lens + np.minimum((tile + 1) * block_q, lens)
    assert (np.diff(ends) <= 0).all() and ends[0] > ends[-1]
    with pytest.raises(ValueError, match="do not fit"):
        prefill_tiles([n for n, _ in specs], block_q, tiles[:2].copy())
    for n in (1, 2, block_q, 3 * block_q + 1):   # a lone sequence's own path lists what the general one does
        alone, beside = np.full(8, 7, dtype=np.int32), np.full(9, 7, dtype=np.int32)
        prefill_tiles([n], block_q, alone)
        prefill_tiles([n, 1], block_q, beside)   # a decode row after it adds no program
        assert alone.tolist() == beside[:8].tolist() and beside[8] == -1
        history = np.array([n + 40, 41])
        prefill_tiles([n], block_q, alone, history)
        prefill_tiles([n, 1], block_q, beside, history)
        assert alone.tolist() == beside[:8].tolist() and beside[8] == -1
    with pytest.raises(ValueError, match="do not fit"):
        prefill_tiles([3 * block_q + 1], block_q, np.empty(3, dtype=np.int32))
