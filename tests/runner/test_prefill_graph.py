"""Prefill graphs' static inputs on the CPU (the Triton kernels under the interpreter, no capture):
a step staged into the padded buffers of a larger bucket gives the eager forward's hidden states,
stores nothing for its padding rows, and leaves no trace of an earlier, larger step. The bucket
list, which steps fit, and the flag combinations refused up front."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from nanoserve import SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.llm import LLM
from nanoserve.runner.batch import SequenceWork
from nanoserve.runner.inputs import build_inputs
from nanoserve.runner.attention.prefill_splits import SEQ_SHIFT
from nanoserve.runner.prefill_graph import (PrefillBuffers, fits_prefill_graph, model_split_buckets,
                                            prefill_graph_bytes, prefill_token_buckets, split_buckets, split_shape)

if torch.cuda.is_available():
    pytest.skip("CPU checks of the static inputs; tests/gpu replays the graphs", allow_module_level=True)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def runner(qwen3_model):
    # two small layers: the interpreter runs one program per token per layer, and two show what four do
    llm = LLM(qwen3_model, device="cpu", attention_backend="triton", max_model_len=128, num_kvcache_blocks=64)
    yield llm.engine.runner
    llm.close()


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SEQS = 6   # the buffers' sequences: a step of fewer leaves some empty


def make_buffers(runner, splitting: bool = False) -> PrefillBuffers:
    # 16 SMs: the interpreter's 4 leave a step of 2 kv heads no room to split into
    shape = dataclasses.replace(split_shape(runner.config), num_sms=16)
    return PrefillBuffers(128, 128 // runner.block_size, runner.device, SEQS, shape.block_q, 128, runner.block_size,
                          splitting=shape if splitting else None)


def eager_hidden(runner, work: list[SequenceWork]) -> torch.Tensor:
    """The hidden states of the eager forward of `work`, packed as build_inputs packs it."""
    inputs = build_inputs(work, runner.block_size, runner.device)
    return runner.model(inputs.input_ids, inputs.positions, inputs.meta)


def padded_forward(runner, work: list[SequenceWork], buffers: PrefillBuffers, bucket: int,
                   seqs: int = SEQS, prompts_only: bool = False, may_split: bool = False) -> torch.Tensor:
    rows, sampling, split = buffers.stage(work, bucket, seqs, may_split=may_split)
    padded_forward.split = split
    n = sum(w.num_new for w in work)
    # each sampling sequence's last query row, as the eager step picks them
    ends = list(itertools.accumulate(w.num_new for w in work))
    assert rows.tolist() == [end - 1 for end, w in zip(ends, work) if w.params is not None]
    assert sampling == [w for w in work if w.params is not None]
    ids, positions, _ = buffers.token_rows(bucket)
    hidden = runner.model(ids, positions, buffers.meta(bucket, seqs, prompts_only, split))
    return hidden[:n]


@torch.inference_mode()
def test_a_padded_step_gives_the_eager_hidden_states_and_stores_only_its_own_slots(runner) -> None:
    bs = runner.block_size
    a, b, c = ids(22, 1), ids(17, 2), ids(5, 3)
    runner.kv_cache.tensor.zero_()   # a fresh cache holds whatever memory held, NaNs included
    # a's first 12 tokens are already cached (a chunked prefill's history), c has 4 of its 5
    runner.run([SequenceWork(a, 22, 0, 12, [0, 1], None), SequenceWork(c, 5, 0, 4, [10], None)])
    # the interpreter runs a program per bucket row and layer: a bucket of 32 under one of 64
    work = [SequenceWork(a, 22, 12, 10, [0, 1], GREEDY),   # the rest of a: keys 0..21, two tiles and blocks
            SequenceWork(b, 17, 0, 17, [5, 6], GREEDY),    # a whole prompt
            SequenceWork(c, 5, 4, 1, [10], GREEDY)]        # one new token, as a decode row is
    cache = runner.kv_cache.tensor
    before = cache.clone()
    buffers = make_buffers(runner)
    # an earlier, larger step leaves stale ids, sequences, tables and programs in the buffers; its
    # positions lie where the smaller bucket reads its padding's slots: slots of a's history
    big = [SequenceWork(ids(10, 4 + i), 10, 0, 10, [20 + 2 * i, 21 + 2 * i], None) for i in range(SEQS)]
    padded_forward(runner, big, buffers, 64)
    before[:, :, 20:32] = cache[:, :, 20:32]
    got = padded_forward(runner, work, buffers, 32)
    # what is not the step's own is padding: no queries, no keys, no stores, no programs
    n = sum(w.num_new for w in work)
    assert buffers.query_start[len(work) + 1:].tolist() == [n] * (SEQS - len(work))
    assert buffers.seq_lens[len(work):].tolist() == [0] * (SEQS - len(work))
    tiles = buffers.tiles[:buffers.num_tiles(32, SEQS)].tolist()
    assert sorted({t >> SEQ_SHIFT for t in tiles if t >= 0}) == [0, 1] and tiles[-1] == -1   # c's decode row: none
    rows = buffers.token_rows(32)
    assert rows[2, n:].eq(-1).all() and rows[:2, n:].eq(0).all()
    stored = cache.clone()
    want = eager_hidden(runner, work)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, stored, rtol=1e-5, atol=1e-5)   # the eager pass stored the same K/V
    slots = {blk * bs + p % bs for w in work for p in range(w.start, w.start + w.num_new)
             for blk in [w.block_table[p // bs]]}
    changed = (stored != before).any(-1).any(-1).any(0).any(0).flatten()   # [blocks, block_size] -> slot
    assert set(torch.nonzero(changed).flatten().tolist()) <= slots


def test_buckets_double_to_1k_then_grow_by_1k() -> None:
    assert prefill_token_buckets(8192) == [16, 32, 64, 128, 256, 512] + list(range(1024, 8193, 1024))
    assert prefill_token_buckets(100) == [16, 32, 64, 100]
    assert prefill_token_buckets(3000) == [16, 32, 64, 128, 256, 512, 1024, 2048, 3000]
    # a large token budget captures no more graphs: larger steps run eagerly
    assert prefill_token_buckets(16384) == prefill_token_buckets(131072) == prefill_token_buckets(8192)


@torch.inference_mode()
def test_a_step_of_many_decode_rows_beside_prompts_gives_the_eager_hidden_states(runner) -> None:
    runner.kv_cache.tensor.zero_()
    histories = [(ids(5 + 5 * i, 30 + i), [40 + 2 * i, 41 + 2 * i]) for i in range(4)]   # 4 sequences to decode
    runner.run([SequenceWork(t, len(t), 0, len(t) - 1, blocks, None) for t, blocks in histories])
    work = [SequenceWork(t, len(t), len(t) - 1, 1, blocks, GREEDY) for t, blocks in histories[:2]]
    work.append(SequenceWork(ids(20, 50), 20, 0, 20, [50, 51], GREEDY))
    work += [SequenceWork(t, len(t), len(t) - 1, 1, blocks, GREEDY) for t, blocks in histories[2:]]
    buffers = make_buffers(runner)
    got = padded_forward(runner, work, buffers, 32)
    want = eager_hidden(runner, work)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_a_prompts_only_graph_over_fewer_sequences_gives_the_eager_hidden_states(runner) -> None:
    runner.kv_cache.tensor.zero_()
    buffers = make_buffers(runner)
    # an earlier mixed step over every sequence leaves stale sequences and programs past the first two
    big = [SequenceWork(ids(10, 60 + i), 10, 0, 10, [20 + 2 * i, 21 + 2 * i], None) for i in range(SEQS)]
    padded_forward(runner, big, buffers, 64)
    # the second is a prompt's first chunk: it samples nothing. Their 4 programs fill 4 of the
    # bucket's 6 entries; the earlier step's programs lie in the other 2
    work = [SequenceWork(ids(17, 70), 17, 0, 17, [0, 1], GREEDY), SequenceWork(ids(17, 71), 17, 0, 8, [2, 3], None)]
    got = padded_forward(runner, work, buffers, 32, seqs=2, prompts_only=True)
    meta = buffers.meta(32, 2, prompts_only=True)
    assert meta.seq_lens.shape[0] == 2 and meta.prefill_tiles.shape[0] == buffers.num_tiles(32, 2)
    want = eager_hidden(runner, work)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_a_lone_chunk_after_its_history_gives_the_eager_hidden_states(runner) -> None:
    # a lone sequence is staged by its own path: positions run on from its history, across blocks
    bs = runner.block_size
    runner.kv_cache.tensor.zero_()
    buffers = make_buffers(runner)
    padded_forward(runner, [SequenceWork(ids(20, 100 + i), 20, 0, 20, [30 + 2 * i, 31 + 2 * i], None)
                            for i in range(3)], buffers, 64)   # stale rows, tables and programs
    prompt = ids(2 * bs + 5, 95)
    blocks = [7, 3, 12]   # out of order: a slot is its table's block, not its position's
    runner.run([SequenceWork(prompt, len(prompt), 0, bs - 3, blocks, None)])
    for params in (None, GREEDY):   # a middle chunk samples nothing; the last samples its last row
        work = [SequenceWork(prompt, len(prompt), bs - 3, bs + 8, blocks, params)]
        rows, sampling, _ = buffers.stage(work, 32, 2)
        assert rows.tolist() == ([bs + 7] if params else []) and sampling == ([work[0]] if params else [])
        token_ids, positions, slots = buffers.token_rows(32).tolist()
        assert token_ids[:bs + 8] == prompt[bs - 3:2 * bs + 5] and token_ids[bs + 8:] == [0] * (24 - bs)
        assert positions[:bs + 8] == list(range(bs - 3, 2 * bs + 5))
        assert slots[:bs + 8] == [blocks[p // bs] * bs + p % bs for p in range(bs - 3, 2 * bs + 5)]
        assert slots[bs + 8:] == [-1] * (24 - bs)
    got = padded_forward(runner, work, buffers, 32, seqs=2, prompts_only=True)
    torch.testing.assert_close(got, eager_hidden(runner, work), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_a_split_step_gives_the_eager_hidden_states_and_a_large_one_is_not_split(runner) -> None:
    # a short chunk after a long history: one program a kv head, its keys split over the SMs
    runner.kv_cache.tensor.zero_()
    buffers = make_buffers(runner, splitting=True)
    shape = buffers.splitting
    assert shape.num_sms // shape.kv_heads >= 2   # the interpreter's SM count leaves room to split
    prompt = ids(126, 110)
    blocks = [9, 4, 15, 2, 11, 6, 13, 17]
    runner.run([SequenceWork(prompt, 126, 0, 120, blocks, None)])
    work = [SequenceWork(prompt, 126, 120, 6, blocks, GREEDY)]
    got = padded_forward(runner, work, buffers, 16, seqs=2, prompts_only=True, may_split=True)
    assert padded_forward.split
    assert (buffers.splits.merges[0] >= 0).all() and (buffers.splits.merges[1:, 0] == -1).all()
    want = eager_hidden(runner, work)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # as many programs as the SMs or more (8 tiles of 8 tokens x 2 kv heads): never split
    wide = [SequenceWork(ids(60, 112), 60, 0, 60, [40, 41, 42, 43], GREEDY)]
    assert not buffers.stage(wide, 64, 2, may_split=True)[2]


@torch.inference_mode()
def test_a_split_step_beside_decode_rows_gives_the_eager_hidden_states(runner) -> None:
    # a turn after a long history arriving while two streams decode: the mixed graph's layout, its
    # prompt's keys split, the decode rows left to the decode launch
    runner.kv_cache.tensor.zero_()
    buffers = make_buffers(runner, splitting=True)
    prompt = ids(126, 120)
    blocks = [9, 4, 15, 2, 11, 6, 13, 17]
    histories = [(ids(12 + 7 * i, 130 + i), [40 + 2 * i, 41 + 2 * i]) for i in range(2)]
    runner.run([SequenceWork(prompt, 126, 0, 118, blocks, None)]
               + [SequenceWork(t, len(t), 0, len(t) - 1, b, None) for t, b in histories])
    work = [SequenceWork(t, len(t), len(t) - 1, 1, b, GREEDY) for t, b in histories[:1]]
    work.append(SequenceWork(prompt, 126, 118, 8, blocks, GREEDY))
    work += [SequenceWork(t, len(t), len(t) - 1, 1, b, GREEDY) for t, b in histories[1:]]
    got = padded_forward(runner, work, buffers, 16, may_split=True)
    assert padded_forward.split
    merges = buffers.splits.merges
    assert merges[0, 0] >> SEQ_SHIFT == 1 and (merges[1:, 0] == -1).all()   # the prompt's one tile, split
    torch.testing.assert_close(got, eager_hidden(runner, work), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("prompts_only, split", list(itertools.product((False, True), (False, True))))
def test_each_graphs_capture_step_runs_over_cleared_buffers_and_stores_nothing(runner, prompts_only, split) -> None:
    # what PrefillGraphs._capture runs, warm-up and capture alike, for each of a small bucket's graphs.
    # Every row is padding: attention leaves its rows as the output's memory held them (NaN, maybe),
    # which nobody reads; what matters is that the step runs and stores nothing
    buffers = make_buffers(runner, splitting=True)
    cache = runner.kv_cache.tensor
    cache.normal_()
    before = cache.clone()
    buffers.clear(16)
    ids_, positions, _ = buffers.token_rows(16)
    hidden = runner.model(ids_, positions, buffers.meta(16, 2 if prompts_only else SEQS, prompts_only, split))
    assert hidden.shape[0] == 16
    assert torch.equal(cache, before)


def test_only_buckets_whose_smallest_step_is_small_get_split_graphs(runner) -> None:
    shape = split_shape(runner.config)
    # the interpreter's 4 "SMs" over 2 kv heads: one prompt of at most one 8-token tile is split
    assert (shape.num_sms, shape.kv_heads, shape.block_q) == (4, 2, 8)
    assert split_buckets([16, 32, 64, 128], shape) == [16]   # 16 holds steps of 2..16 tokens; 32 of 17..32
    assert split_buckets([8, 16, 32], shape) == [8]


def test_a_prompts_only_graph_launches_no_decode_kernel_and_a_mixed_one_does(runner, monkeypatch) -> None:
    from nanoserve.runner.attention import triton_kernels
    launches = []
    real = triton_kernels.paged_decode
    monkeypatch.setattr(triton_kernels, "paged_decode", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    buffers = make_buffers(runner)
    work = [SequenceWork(ids(12, 80), 12, 0, 12, [0], GREEDY)]
    with torch.inference_mode():
        padded_forward(runner, work, buffers, 16, seqs=2, prompts_only=True)
        assert launches == []
        padded_forward(runner, work, buffers, 16)
    assert len(launches) == runner.model.config.num_hidden_layers


def test_which_steps_fit() -> None:
    one = lambda n, **kw: SequenceWork(list(range(n)), n, 0, n, [0], GREEDY, **kw)  # noqa: E731
    assert fits_prefill_graph([one(1000)], 1024, 4)
    assert fits_prefill_graph([one(10)] * 4, 1024, 4)
    assert not fits_prefill_graph([one(10)] * 5, 1024, 4)
    assert fits_prefill_graph([one(1)] * 300 + [one(600)], 1024, 512)
    assert not fits_prefill_graph([one(600), one(600)], 1024, 4)
    assert not fits_prefill_graph([one(10, prompt_logprobs=1)], 1024, 4)


def test_a_model_with_a_sliding_window_gets_no_split_graphs_nor_their_memory(tmp_path) -> None:
    from tests.conftest import _random_model
    sizes = {}
    for window in (None, 32):
        folder = _random_model(tmp_path / f"w{window}", "mistral", num_key_value_heads=1, sliding_window=window)
        config = EngineConfig(model=folder, device="cpu", max_model_len=128, max_num_batched_tokens=128,
                              max_num_seqs=4)
        sizes[window] = (model_split_buckets(config), prefill_graph_bytes(config, 64, 0))
    assert sizes[None][0] == split_buckets(prefill_token_buckets(128), split_shape(config)) != []
    assert sizes[32][0] == [] and sizes[32][1] < sizes[None][1]


@pytest.mark.parametrize("kwargs, why", [
    (dict(), "need CUDA"),
    (dict(enforce_eager=True), "enforce-eager"),
    (dict(tensor_parallel_size=2), "one GPU"),
    (dict(attention_backend="flash_attn"), "triton attention backend, not flash_attn"),
    (dict(attention_backend="torch"), "triton attention backend, not torch"),
])
def test_flag_combinations_that_rule_prefill_graphs_out_are_refused(kwargs, why) -> None:
    with pytest.raises(ValueError, match=why):
        EngineConfig(device="cpu", prefill_cuda_graphs=True, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(), dict(enforce_eager=True), dict(tensor_parallel_size=2),
                                    dict(attention_backend="torch")])
def test_prefill_graphs_by_default_turn_off_quietly_where_they_cannot_run(kwargs) -> None:
    assert EngineConfig(device="cpu", **kwargs).prefill_cuda_graphs is False


def test_staging_puts_the_previous_launchs_ids_where_the_host_had_placeholders(runner) -> None:
    # pipelined scheduling: a decode row's input is the id the last launch sampled, still on the device
    buffers = make_buffers(runner)
    prev = torch.tensor([501, 502, 503])
    prompt, history = ids(12, 90), ids(7, 91) + [-1]
    work = [SequenceWork(prompt, 12, 0, 12, [0], GREEDY),
            SequenceWork(history, 7, 7, 1, [1], GREEDY, prev_row=2)]
    for _ in range(3):   # both host sets, and a set used again
        rows, _, _ = buffers.stage(work, 32, SEQS, prev)
        token_ids, positions, slots = buffers.token_rows(32)[:, :13].tolist()
        assert token_ids == prompt + [503]
        assert positions == list(range(12)) + [7]
        assert slots == list(range(12)) + [runner.block_size + 7]
        assert rows.tolist() == [11, 12]
