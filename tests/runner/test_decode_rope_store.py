"""Decode attention that makes its rows' q, k and v from the packed projection itself (rope=...):
against qkv_rope_store then decode over the stored cache, under the Triton interpreter. The
cache and the output must come out bit for bit as the two launches leave them."""

from __future__ import annotations

import pytest
import torch

from nanoserve.runner.attention.decode_splits import longest_first
from nanoserve.runner.attention.fp8 import FP8_DTYPE
from nanoserve.runner.attention.kv_layout import v_cache_view
from nanoserve.runner.attention.triton_decode import paged_decode
from nanoserve.runner.attention.triton_rope_store import qkv_rope_store
from nanoserve.runner.layers.rotary import NewTokenRope
from tests.runner.test_rope_store_kernel import rotary_tables

if torch.cuda.is_available():
    pytest.skip("the GPU version of this check lives in tests/gpu", allow_module_level=True)

BLOCK, BLOCKS, HEADS, KV_HEADS, DIM = 16, 40, 4, 2, 32
# keys per sequence with the new one: a padding row, a lone key, a new key opening a block, one
# closing a block, and contexts over several blocks and splits
SEQ_LENS = [37, 0, 1, 17, 64, 90]


def make_caches(fp8: bool, v_tokens: bool, dtype: torch.dtype, gen: torch.Generator):
    shape = (BLOCKS, BLOCK, KV_HEADS, DIM)
    k_cache = torch.randn(shape, generator=gen).to(FP8_DTYPE if fp8 else dtype)
    v_cache = torch.randn(shape, generator=gen).to(FP8_DTYPE if fp8 else dtype)
    if v_tokens:
        v_cache = v_cache_view(v_cache.clone(), fp8=True)
        v_cache.copy_(torch.randn(shape, generator=gen).to(FP8_DTYPE))
    return k_cache, v_cache


def clone_cache(cache: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype)
    out.copy_(cache)
    return out


def new_key_slots(seq_lens: torch.Tensor, tables: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's new position (seq_len - 1) and its cache slot, -1 for a padding row."""
    positions = (seq_lens - 1).clamp_min(0).long()
    slots = torch.where(seq_lens > 0, tables.long().gather(1, (positions // block)[:, None])[:, 0] * block
                        + positions % block, -1)
    return positions, slots


def split_args(splits: str, seq_lens: torch.Tensor) -> dict:
    return {"one": dict(num_splits=1), "even": dict(num_splits=3),
            "fixed keys, longest first": dict(split_keys=32, seq_order=longest_first(seq_lens))}[splits]


SPLITS = ["one", "even", "fixed keys, longest first"]
CACHES = ["auto", "fp8", "fp8 V along tokens"]
DTYPES = [torch.float32, torch.float16]
# Every split kind x cache x dtype; the q/k norm on in half of them. Which program norms and stores
# the new key is the split's choice alone and the norm comes before the store whatever it is, so each
# (cache, dtype) meets the norm on and off, and each split kind meets both: the other half of the full
# product took no branch these do not
ROPE_CASES = [pytest.param(dtype, (i + j + k) % 2 == 0, cache, splits,
                           id=f"{splits}-{cache}-{'norm' if (i + j + k) % 2 == 0 else 'no norm'}-{dtype}")
              for i, splits in enumerate(SPLITS) for j, cache in enumerate(CACHES) for k, dtype in enumerate(DTYPES)]


@pytest.mark.parametrize("dtype,qk_norm,kv_cache_dtype,splits", ROPE_CASES)
def test_decode_with_rope_stores_and_attends_as_the_two_launches(dtype, qk_norm, kv_cache_dtype, splits) -> None:
    gen = torch.Generator().manual_seed(len(splits) + qk_norm)
    batch = len(SEQ_LENS)
    fp8 = kv_cache_dtype.startswith("fp8")
    k_cache, v_cache = make_caches(fp8, kv_cache_dtype.endswith("tokens"), dtype, gen)
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(dtype)
    cos, sin = rotary_tables(DIM)
    weights = ((1 + 0.3 * torch.randn(2, DIM, generator=gen)).to(dtype).unbind(0) if qk_norm else (None, None))
    rope = NewTokenRope(cos, sin, *weights, 1e-6)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    tables = torch.randperm(BLOCKS, generator=gen)[:batch * 6].reshape(batch, 6).to(torch.int32)
    positions, slots = new_key_slots(seq_lens, tables, BLOCK)
    k_scale, v_scale = (0.5, 2.0) if fp8 else (1.0, 1.0)
    kw = dict(k_scale=k_scale, v_scale=v_scale, **split_args(splits, seq_lens))

    want_k, want_v = clone_cache(k_cache), clone_cache(v_cache)
    q = qkv_rope_store(positions, qkv, HEADS, KV_HEADS, DIM, cos, sin, *weights, 1e-6, want_k, want_v, slots,
                       k_scale, v_scale)
    want = paged_decode(q, want_k, want_v, seq_lens, tables, 0.25, max_seq_len=96, **kw)
    q_columns = qkv[:, :HEADS * DIM].unflatten(1, (HEADS, DIM))
    got = paged_decode(q_columns, k_cache, v_cache, seq_lens, tables, 0.25, max_seq_len=96, rope=rope, **kw)

    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    assert torch.equal(got, want)
    assert (got[1] == 0).all(), "a padding row reads and writes nothing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", ["one", "even", "fixed keys, longest first"])
@pytest.mark.parametrize("block", [16, 64])
def test_decode_storing_new_v_leaves_the_cache_and_output_of_the_store_kernel(dtype, splits, block) -> None:
    """qkv_rope_store(store_v=False) then paged_decode(new_v=...): the decode kernel writes each row's
    v into an fp8 cache whose V lies along tokens, a whole sector a dim; the cache and the output
    come out bit for bit as the store kernel's v then decode leave them. At block 64 a sector holds 32
    of a block's tokens; at 16 the sector is the block's row of one dim."""
    gen = torch.Generator().manual_seed(len(splits) + block)
    batch, width = len(SEQ_LENS), -(-max(SEQ_LENS) // block)
    blocks = batch * width + 4
    shape = (blocks, block, KV_HEADS, DIM)
    k_cache = torch.randn(shape, generator=gen).to(FP8_DTYPE)
    v_cache = v_cache_view(torch.empty(shape, dtype=FP8_DTYPE), fp8=True)
    v_cache.copy_(torch.randn(shape, generator=gen).to(FP8_DTYPE))
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(dtype)
    cos, sin = rotary_tables(DIM)
    weights = (1 + 0.3 * torch.randn(2, DIM, generator=gen)).to(dtype).unbind(0)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    tables = torch.randperm(blocks, generator=gen)[:batch * width].reshape(batch, width).to(torch.int32)
    positions, slots = new_key_slots(seq_lens, tables, block)
    kw = dict(k_scale=0.5, v_scale=2.0, **split_args(splits, seq_lens))

    want_k, want_v = clone_cache(k_cache), clone_cache(v_cache)
    q = qkv_rope_store(positions, qkv, HEADS, KV_HEADS, DIM, cos, sin, *weights, 1e-6, want_k, want_v, slots,
                       0.5, 2.0)
    want = paged_decode(q, want_k, want_v, seq_lens, tables, 0.25, max_seq_len=96, **kw)
    before_v = clone_cache(v_cache)
    q = qkv_rope_store(positions, qkv, HEADS, KV_HEADS, DIM, cos, sin, *weights, 1e-6, k_cache, v_cache, slots,
                       0.5, 2.0, store_v=False)
    assert torch.equal(v_cache.view(torch.uint8), before_v.view(torch.uint8)), "store_v=False writes no v"
    new_v = qkv[:, (HEADS + KV_HEADS) * DIM:].unflatten(1, (KV_HEADS, DIM))
    got = paged_decode(q, k_cache, v_cache, seq_lens, tables, 0.25, max_seq_len=96, new_v=new_v, **kw)

    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    assert torch.equal(got, want)
    assert (got[1] == 0).all(), "a padding row reads and writes nothing"


def test_new_v_is_refused_where_the_decode_kernel_cannot_store_it() -> None:
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = make_caches(True, False, torch.float32, gen)   # fp8, V row by row
    seq_lens, tables = torch.tensor([3, 5], dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32)
    q, new_v = torch.randn(2, HEADS, DIM), torch.randn(2, KV_HEADS, DIM)
    with pytest.raises(ValueError, match="along tokens"):
        paged_decode(q, k_cache, v_cache, seq_lens, tables, 0.25, max_seq_len=64, new_v=new_v)
    k_cache, v_cache = make_caches(True, True, torch.float32, gen)
    with pytest.raises(ValueError, match=r"new_v must be \[2, 2, 32\]"):
        paged_decode(q, k_cache, v_cache, seq_lens, tables, 0.25, max_seq_len=64, new_v=new_v[:, :1])


def test_rope_refuses_q_that_is_not_the_packed_projections() -> None:
    k_cache, v_cache = make_caches(False, False, torch.float32, torch.Generator().manual_seed(0))
    cos, sin = rotary_tables(DIM)
    q = torch.randn(2, HEADS, DIM)   # q alone: no k and v columns after it
    with pytest.raises(ValueError, match="packed projection"):
        paged_decode(q, k_cache, v_cache, torch.tensor([3, 5], dtype=torch.int32),
                     torch.zeros(2, 1, dtype=torch.int32), 0.25, max_seq_len=64,
                     rope=NewTokenRope(cos, sin, None, None, 1e-6))


def test_a_lone_rows_q_view_is_taken_whatever_its_row_stride() -> None:
    """At batch 1 the q columns' view of the projection may carry any row stride (torch picks one
    for a dimension of size 1): the kernel never steps over it, so the check must not refuse it."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = make_caches(False, False, torch.float32, gen)
    qkv = torch.randn(1, (HEADS + 2 * KV_HEADS) * DIM, generator=gen)
    q = torch.as_strided(qkv, (1, HEADS, DIM), (HEADS * DIM, DIM, 1))
    cos, sin = rotary_tables(DIM)
    seq_lens, tables = torch.tensor([20], dtype=torch.int32), torch.tensor([[3, 7]], dtype=torch.int32)
    want_k, want_v = clone_cache(k_cache), clone_cache(v_cache)
    q_ref = qkv_rope_store(torch.tensor([19]), qkv, HEADS, KV_HEADS, DIM, cos, sin, None, None, 1e-6, want_k, want_v,
                           torch.tensor([7 * BLOCK + 3]))
    want = paged_decode(q_ref, want_k, want_v, seq_lens, tables, 0.25, max_seq_len=96)
    got = paged_decode(q, k_cache, v_cache, seq_lens, tables, 0.25, max_seq_len=96,
                       rope=NewTokenRope(cos, sin, None, None, 1e-6))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_models_decode_steps_through_the_triton_backend_give_the_torch_backends_tokens(qwen3_model,
                                                                                          kv_cache_dtype) -> None:
    """The model hands its packed projection to the backend (attend_qkv): a lone decode row takes the
    decode kernel's rope and store, other steps the separate store kernel; greedy tokens as the
    torch backend's, whose store and attention are plain torch."""
    from nanoserve import LLM, SamplingParams

    prompts = [[7, 100, 3, 250, 9], list(range(30, 60)), [5]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(qwen3_model, device="cpu", attention_backend=backend, max_model_len=128, num_kvcache_blocks=64,
                  kv_cache_dtype=kv_cache_dtype)
        try:
            # three rows a step, then one alone: batch 1 takes the decode kernel's store (DECODE_ROPE_MAX_ROWS)
            tokens[backend] = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
            tokens[backend] += [out.token_ids for out in llm.generate(prompts[1:2], params, use_tqdm=False)]
        finally:
            llm.close()
    assert all(len(t) == 8 for t in tokens["triton"])
    assert tokens["triton"] == tokens["torch"]
