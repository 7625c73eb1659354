"""Sliding-window attention: a query at position p attends the keys k with p - W < k <= p, as
transformers masks it (masking_utils.sliding_window_causal_mask_function). The torch reference
against that mask over a dense computation, then the Triton kernels (under the interpreter)
against the reference: prefill tiles before, across and after the window's edge, decode splits
that would lie wholly before it, mixed steps, an fp8 cache and the decode kernel's own K/V store."""

from __future__ import annotations

import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function

from nanoserve.positions import layer_windows
from nanoserve.runner.attention import TorchBackend
from nanoserve.runner.attention.decode_splits import longest_first
from nanoserve.runner.attention.fp8 import FP8_DTYPE, quantize_fp8
from nanoserve.runner.attention.kv_layout import tokens_contiguous, v_cache_copy, v_cache_view
from nanoserve.runner.attention.torch_backend import gather_kv
from nanoserve.runner.attention.triton_decode import paged_decode
from nanoserve.runner.attention.triton_kernels import TritonBackend, store_kvcache
from nanoserve.runner.attention.triton_prefill import paged_prefill
from nanoserve.runner.attention.triton_rope_store import qkv_rope_store
from nanoserve.runner.layers.rotary import NewTokenRope
from tests.runner.test_decode_rope_store import BLOCK, BLOCKS, DIM, HEADS, KV_HEADS, clone_cache, new_key_slots
from tests.runner.test_rope_store_kernel import rotary_tables
from tests.runner.test_triton_attention import NanWorkspace, assert_close, make_step

if torch.cuda.is_available():
    pytest.skip("the kernels run under the Triton interpreter here", allow_module_level=True)

# prompts longer than the windows, a prefix hit, chunks after chunks (one starting past the window,
# one on a tile's last key), a padding row and decode rows
PREFILL_SPECS = [(70, 70), (9, 49), (17, 50), (20, 35), (1, 0), (1, 38), (40, 100)]
DECODE_SPECS = [(1, 70), (1, 0), (1, 33), (1, 5), (1, 64), (1, 16), (1, 17), (1, 130)]
WINDOWS = [1, 5, 16, 37]


def dense_with_transformers_mask(q, k_cache, v_cache, meta, scale, window):
    """Each sequence's attention over its gathered keys, masked by transformers' own mask function."""
    allowed = sliding_window_causal_mask_function(window)
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]
    start = 0
    for i, (q_len, kv_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        rows = slice(start, start + q_len)
        start += q_len
        if kv_len == 0:
            continue
        keys = gather_kv(k_cache, meta.block_tables[i], kv_len).repeat_interleave(group, 1)
        values = gather_kv(v_cache, meta.block_tables[i], kv_len).repeat_interleave(group, 1)
        q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
        mask = allowed(0, 0, q_pos, torch.arange(kv_len)[None, :])
        scores = torch.einsum("qhd,khd->hqk", q[rows], keys) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


def reference(q, k, v, k_cache, v_cache, meta, scale, window=None, k_scale=1.0, v_scale=1.0):
    """The torch backend in float32 on copies of the caches (an fp8 cache stays fp8): (out, k_cache, v_cache)."""
    kc, vc = (c.clone() if c.dtype.itemsize == 1 else c.float().clone() for c in (k_cache, v_cache))
    out = TorchBackend().forward(q.float(), k.float(), v.float(), kc, vc, meta, scale, k_scale, v_scale, window)
    return out, kc, vc


def live_rows(meta) -> torch.Tensor:
    """The query rows of sequences that are not padding."""
    return torch.repeat_interleave(torch.tensor(meta.seq_lens_host) > 0, torch.tensor(meta.query_lens_host))


def step(specs, seed, group=2, block_size=16, head_dim=64):
    return make_step(specs, block_size=block_size, kv_heads=2, group=group, head_dim=head_dim,
                     dtype=torch.float32, seed=seed)


@pytest.mark.parametrize("window", WINDOWS)
def test_the_reference_window_is_transformers_mask(window) -> None:
    q, k, v, k_cache, v_cache, meta = step(PREFILL_SPECS, seed=1)
    out, kc, vc = reference(q, k, v, k_cache, v_cache, meta, 0.125, window)
    assert_close(out, dense_with_transformers_mask(q, kc, vc, meta, 0.125, window), torch.float32)
    # the window changes the answer of every query that has keys past it, and of no other
    full, _, _ = reference(q, k, v, k_cache, v_cache, meta, 0.125)
    positions = torch.cat([torch.arange(s - n, s) for n, s in zip(meta.query_lens_host, meta.seq_lens_host)])
    differs = (out - full).abs().amax((1, 2)) > 1e-6
    assert torch.equal(differs, positions >= window)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_m", [16, 64])   # query tiles of 8 and 32 tokens: shorter and longer than windows
def test_prefill_with_a_window_matches_the_reference(window, block_m) -> None:
    q, k, v, k_cache, v_cache, meta = step(PREFILL_SPECS, seed=10 + window)
    # the caches as the reference stored the step's keys: store_kvcache writes the same bits
    # (test_triton_attention), and under the interpreter it is a program a token
    want, k_cache, v_cache = reference(q, k, v, k_cache, v_cache, meta, 0.125, window)
    out = paged_prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125,
                        meta.max_query_len, config=dict(BLOCK_M=block_m, BLOCK_N=16, num_warps=1, num_stages=1),
                        window=window)
    live = live_rows(meta)
    assert_close(out[live], want[live], torch.float32)


@pytest.mark.parametrize("window", [5, 37])
@pytest.mark.parametrize("mixed_rows", [100, 2])   # decode rows in the prefill launch, or the decode kernel's
def test_a_mixed_step_with_a_window_matches_the_reference(window, mixed_rows, monkeypatch) -> None:
    import nanoserve.runner.attention.triton_kernels as triton_kernels
    monkeypatch.setattr(triton_kernels, "MIXED_MIN_DECODE_ROWS", mixed_rows)
    q, k, v, k_cache, v_cache, meta = step(PREFILL_SPECS, seed=20 + window)
    want, want_k, want_v = reference(q, k, v, k_cache, v_cache, meta, 0.125, window)
    out = TritonBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125, window=window)
    live = live_rows(meta)   # the prefill kernel leaves a padding row's output undefined, window or not
    assert_close(out[live], want[live], torch.float32)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


SPLITS = {"one": dict(num_splits=1), "two": dict(num_splits=2), "three": dict(num_splits=3),
          "eight": dict(num_splits=8), "fixed keys": dict(split_keys=16),
          "fixed keys, longest first": dict(split_keys=32, order=True)}


# each window once, with the table read per key or a tile ahead (the two loops of the decode kernel)
@pytest.mark.parametrize("window,block_ahead", [(1, False), (5, True), (16, False), (37, True)])
@pytest.mark.parametrize("splits", list(SPLITS))
def test_decode_with_a_window_matches_the_reference(window, splits, block_ahead, monkeypatch) -> None:
    """Splits are counted from the window's first tile: none lies wholly before it, and the merge
    reads only partials that a split wrote (the workspace starts as NaN)."""
    import nanoserve.runner.attention.triton_decode as triton_decode
    monkeypatch.setattr(triton_decode, "torch", NanWorkspace())
    q, k, v, k_cache, v_cache, meta = step(DECODE_SPECS, seed=30 + window, block_size=32)
    want, _, _ = reference(q, k, v, k_cache, v_cache, meta, 0.125, window)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    kw = dict(SPLITS[splits])
    if kw.pop("order", False):
        kw["seq_order"] = longest_first(meta.seq_lens)
    out = paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.125, 4096, window=window,
                       config=dict(BLOCK_AHEAD=block_ahead, BLOCK_N=16), **kw)
    assert (out[1] == 0).all(), "a padding row must come back as zeros"
    assert_close(out, want, torch.float32)


@pytest.mark.parametrize("window", [None, 37, 300])
def test_decode_splits_are_counted_over_the_keys_a_window_reads(window, monkeypatch) -> None:
    """On a GPU of many SMs the engine's count divides only the window's tiles: a split of fewer than
    MIN_TOKENS_PER_SPLIT keys costs more in merging than it saves, and each split past the window's
    tiles is an empty program."""
    import nanoserve.runner.attention.decode_splits as decode_splits
    import nanoserve.runner.attention.triton_decode as triton_decode
    monkeypatch.setattr(decode_splits, "num_sms", lambda device: 1024)
    counts = []
    count = triton_decode.decode_split_count
    monkeypatch.setattr(triton_decode, "decode_split_count", lambda *a: counts.append(count(*a)) or counts[-1])
    q, k, v, k_cache, v_cache, meta = step(DECODE_SPECS, seed=40, block_size=32)
    want, _, _ = reference(q, k, v, k_cache, v_cache, meta, 0.125, window)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.125, 4096, window=window,
                       config=dict(BLOCK_N=16))
    assert_close(out, want, torch.float32)
    # 4,096 keys over splits of at least 256; a window of 37 (52 keys in its tiles) or 300 (315)
    assert counts == [{None: 16, 37: 1, 300: 2}[window]]


def fp8_step(specs, window):
    """The step in float16 over an fp8 cache with V along tokens (as the engine lays it out), its new
    keys stored as the reference stores them (store_kvcache's bits: test_fp8_kv_cache):
    (q, fp8 caches, meta, the reference's output)."""
    q, k, v, k_cache, v_cache, meta = step(specs, seed=40 + window)
    q, k, v = (t.half() for t in (q, k, v))
    fp8 = quantize_fp8(k_cache, 2.0), v_cache_copy(quantize_fp8(v_cache, 4.0))
    want, k_cache, v_cache = reference(q, k, v, *fp8, meta, 0.125, window, 2.0, 4.0)
    assert k_cache.dtype == v_cache.dtype == FP8_DTYPE and tokens_contiguous(v_cache)
    return q, (k_cache, v_cache), meta, want


@pytest.mark.parametrize("window", [5, 37])
@pytest.mark.parametrize("splits", ["one", "three", "fixed keys"])
def test_decode_with_a_window_over_an_fp8_cache_matches_the_reference(window, splits) -> None:
    """V along tokens: a tile's V is read whole, keys before the window included, which must weigh
    nothing."""
    q, fp8, meta, want = fp8_step(DECODE_SPECS, window)
    out = paged_decode(q, *fp8, meta.seq_lens, meta.block_tables, 0.125, 4096,
                       k_scale=2.0, v_scale=4.0, window=window, **SPLITS[splits])
    assert (out[1] == 0).all(), "a padding row must come back as zeros"
    err = (out.float() - want).norm() / want.norm()
    assert err < 2e-3


# the prefill kernel takes no splits: one launch a window, not one for each of the decode test's splits
@pytest.mark.parametrize("window", [5, 37])
def test_prefill_with_a_window_over_an_fp8_cache_matches_the_reference(window) -> None:
    """As the decode test: a V tile read whole across the window's first key (decode rows ride
    along, as in a step that leaves them in the prefill launch)."""
    q, fp8, meta, want = fp8_step(DECODE_SPECS + PREFILL_SPECS, window)
    prompts = paged_prefill(q, *fp8, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125,
                            meta.max_query_len, k_scale=2.0, v_scale=4.0, window=window)
    live = live_rows(meta)
    live[:len(DECODE_SPECS)] = False
    assert_close(prompts[live], want[live], torch.float16)


@pytest.mark.parametrize("store", ["rope", "new v"])
@pytest.mark.parametrize("splits", ["one", "three", "fixed keys"])
def test_decode_storing_its_own_kv_with_a_window_matches_the_two_launches(store, splits) -> None:
    """The decode kernel's own K/V store (rope=, new_v=) is done by the split whose keys hold the
    new position, counted from the window's first tile as the attention is."""
    gen = torch.Generator().manual_seed(50)
    seq_lens = torch.tensor([37, 0, 1, 17, 64, 90], dtype=torch.int32)
    batch = seq_lens.shape[0]
    shape = (BLOCKS, BLOCK, KV_HEADS, DIM)
    k_cache = torch.randn(shape, generator=gen).to(FP8_DTYPE)
    v_cache = v_cache_view(torch.randn(shape, generator=gen).to(FP8_DTYPE), fp8=True)
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * DIM, generator=gen)
    cos, sin = rotary_tables(DIM)
    tables = torch.randperm(BLOCKS, generator=gen)[:batch * 6].reshape(batch, 6).to(torch.int32)
    positions, slots = new_key_slots(seq_lens, tables, BLOCK)
    kw = dict(k_scale=0.5, v_scale=2.0, window=20, **SPLITS[splits])
    want_k, want_v = clone_cache(k_cache), clone_cache(v_cache)
    q = qkv_rope_store(positions, qkv, HEADS, KV_HEADS, DIM, cos, sin, None, None, 1e-6, want_k, want_v, slots,
                       0.5, 2.0)
    want = paged_decode(q, want_k, want_v, seq_lens, tables, 0.25, max_seq_len=96, **kw)
    if store == "rope":
        got = paged_decode(qkv[:, :HEADS * DIM].unflatten(1, (HEADS, DIM)), k_cache, v_cache, seq_lens, tables,
                           0.25, max_seq_len=96, rope=NewTokenRope(cos, sin, None, None, 1e-6), **kw)
    else:
        q2 = qkv_rope_store(positions, qkv, HEADS, KV_HEADS, DIM, cos, sin, None, None, 1e-6, k_cache, v_cache,
                            slots, 0.5, 2.0, store_v=False)
        new_v = qkv[:, (HEADS + KV_HEADS) * DIM:].unflatten(1, (KV_HEADS, DIM))
        got = paged_decode(q2, k_cache, v_cache, seq_lens, tables, 0.25, max_seq_len=96, new_v=new_v, **kw)
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    assert torch.equal(got, want)


def test_layer_windows_follow_the_config_as_transformers_does() -> None:
    from transformers import MistralConfig, Qwen2Config
    mistral = MistralConfig(num_hidden_layers=3, sliding_window=64, max_position_embeddings=256)
    assert layer_windows(mistral) == [64, 64, 64]
    assert layer_windows(mistral, max_model_len=64) == [None] * 3   # no position reaches past the window
    assert layer_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    # Qwen2: sliding from max_window_layers on, and only with use_sliding_window
    qwen2 = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert qwen2.layer_types == ["full_attention"] + ["sliding_attention"] * 3
    assert layer_windows(qwen2) == [None, 16, 16, 16]
    assert layer_windows(Qwen2Config(num_hidden_layers=2, use_sliding_window=False, sliding_window=16)) == [None] * 2


@pytest.mark.parametrize("window", [0, -3])
def test_both_kernels_refuse_a_window_of_no_keys(window) -> None:
    q, _, _, k_cache, v_cache, meta = step(DECODE_SPECS, seed=50)
    with pytest.raises(ValueError, match="at least one key"):
        paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.125, 4096, window=window)
    with pytest.raises(ValueError, match="at least one key"):
        paged_prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125,
                      meta.max_query_len, window=window)
