"""The CUDA-graph staging buffers hold the same decode inputs as the eager path, plus padding rows
that write and read nothing. Staging is plain tensor work, so it is checked on the CPU."""

from __future__ import annotations

import random

import pytest

import torch

from nanoserve.runner.batch import PENDING_TOKEN, SequenceWork
from nanoserve.runner.cuda_graph import DecodeBuffers
from nanoserve.runner.inputs import build_inputs
from nanoserve.sampling_params import SamplingParams

BLOCK = 4


def decode_work(rng: random.Random, n: int, num_blocks: int = 200) -> list[SequenceWork]:
    free = rng.sample(range(num_blocks), num_blocks)  # shuffled: no row reads a neighbour's block
    work = []
    for row in range(n):
        length = rng.randint(1, 30)
        blocks = [free.pop() for _ in range(-(-length // BLOCK))]
        tokens = [rng.randint(0, 99) for _ in range(length)]
        work.append(SequenceWork(tokens, 1, length - 1, 1, blocks, SamplingParams(temperature=0)))
    return work


def staged(buffers: DecodeBuffers, work: list[SequenceWork], batch: int, prev=None):
    buffers.stage(work, batch, prev)
    meta = buffers.meta(batch)
    return buffers.dev_i64[0, :batch], buffers.dev_i64[1, :batch], meta


def test_a_negative_engine_seed_seeds_the_draws_as_torch_reads_it():
    """numpy refuses negative seeds: `serve --seed -1` failed to start wherever decode graphs are captured."""
    def noise_seeds(seed: int) -> torch.Tensor:
        buffers = DecodeBuffers(4, max_blocks=8, max_model_len=32, block_size=BLOCK, device=torch.device("cpu"),
                                seed=seed)
        buffers.stage(decode_work(random.Random(0), 4), 4, None)
        return buffers.dev_i64[3].clone()

    assert torch.equal(noise_seeds(-1), noise_seeds(2**64 - 1))


def test_staged_rows_equal_the_eager_inputs_and_padding_reads_nothing():
    rng = random.Random(0)
    buffers = DecodeBuffers(16, max_blocks=8, max_model_len=32, block_size=BLOCK, device=torch.device("cpu"))
    for n, batch in ((11, 16), (3, 4), (16, 16)):  # shrinking batches leave stale rows behind
        work = decode_work(rng, n)
        ids, positions, meta = staged(buffers, work, batch)
        eager = build_inputs(work, BLOCK, torch.device("cpu"))
        assert torch.equal(ids[:n], eager.input_ids) and torch.equal(positions[:n], eager.positions)
        assert torch.equal(meta.slot_mapping[:n], eager.meta.slot_mapping)
        assert torch.equal(meta.seq_lens[:n], eager.meta.seq_lens)
        width = eager.meta.block_tables.shape[1]
        real = eager.meta.block_tables >= 0
        assert torch.equal(meta.block_tables[:n, :width][real], eager.meta.block_tables[real])
        assert (meta.slot_mapping[n:] == -1).all() and (meta.seq_lens[n:] == 0).all()
        assert meta.seq_lens.is_contiguous() and meta.block_tables.stride(-1) == 1


def test_pending_tokens_come_from_the_previous_launch():
    rng = random.Random(1)
    buffers = DecodeBuffers(8, max_blocks=8, max_model_len=32, block_size=BLOCK, device=torch.device("cpu"))
    work = decode_work(rng, 5)
    prev = torch.tensor([70, 71, 72])
    for row, prev_row in ((1, 2), (4, 0)):
        work[row].token_ids[-1] = PENDING_TOKEN
        work[row].prev_row = prev_row
    ids, _, _ = staged(buffers, work, 8, prev)
    assert ids[1] == 72 and ids[4] == 70
    assert ids[0] == work[0].token_ids[-1] and ids[2] == work[2].token_ids[-1]


def test_padding_rows_never_carry_a_placeholder_from_an_earlier_step():
    """A row that held a pending token and then becomes padding must still embed a real id."""
    rng = random.Random(2)
    buffers = DecodeBuffers(8, max_blocks=8, max_model_len=32, block_size=BLOCK, device=torch.device("cpu"))
    work = decode_work(rng, 8)
    for row, w in enumerate(work):
        w.token_ids[-1] = PENDING_TOKEN
        w.prev_row = row
    staged(buffers, work, 8, torch.arange(8) + 50)
    for _ in range(2):  # both host staging sets
        ids, positions, meta = staged(buffers, decode_work(rng, 5), 8)
        assert (ids >= 0).all() and (positions >= 0).all()
        assert (ids[5:] == 0).all() and (meta.slot_mapping[5:] == -1).all()


def test_the_in_graph_draw_reads_each_rows_inverse_temperature_bit_for_bit():
    """Staged on the host, 1 / T must equal what gumbel_argmax computes on the device, or a graph's
    draw could differ from the same draw outside it; padding rows draw greedily."""
    from nanoserve.runner.sampling_kernel import inverse_temperature

    rng = random.Random(3)
    buffers = DecodeBuffers(16, max_blocks=8, max_model_len=32, block_size=BLOCK, device=torch.device("cpu"))
    work = decode_work(rng, 13)
    temps = [0.0, 1.0, 0.7, 1e-5, 3e-5, 2.0, 0.1, 1 / 3, 100.0, 0.0, 5.5, 0.123456789, 1e4]
    for w, t in zip(work, temps):
        w.params = SamplingParams(temperature=t)
    staged(buffers, work, 16)
    want = inverse_temperature(torch.tensor([w.params.temperature for w in work]))
    got = buffers.dev_inv_temp
    assert torch.equal(got[:13], want) and (got[13:] == 0).all()
    assert got[0] == 0 and got[1] == 1
    seeds = buffers.dev_i64[3, :16]
    assert (seeds >= 0).all() and (seeds < 2**31 - 1).all() and len(set(seeds.tolist())) > 12
    first = seeds.clone()
    staged(buffers, work, 16)
    assert not torch.equal(buffers.dev_i64[3, :16], first), "each step draws fresh noise"


def ask_longest_first(monkeypatch, asked: str | None) -> None:
    if asked is None:
        monkeypatch.delenv("NANOSERVE_LONGEST_FIRST", raising=False)
    else:
        monkeypatch.setenv("NANOSERVE_LONGEST_FIRST", asked)


@pytest.mark.parametrize("asked, fp8_cache", [(None, True), ("1", False)])
def test_longest_first_stages_the_rows_by_falling_length_padding_last(monkeypatch, asked, fp8_cache):
    ask_longest_first(monkeypatch, asked)
    rng = random.Random(3)
    buffers = DecodeBuffers(16, max_blocks=8, max_model_len=32, block_size=BLOCK, device=torch.device("cpu"),
                            fp8_cache=fp8_cache)
    for n, batch in ((11, 16), (3, 4)):
        _, _, meta = staged(buffers, decode_work(rng, n), batch)
        order = meta.decode_order
        assert order.dtype == torch.int32 and order.is_contiguous()
        assert sorted(order.tolist()) == list(range(batch))
        lens = meta.seq_lens[order.long()].tolist()
        assert lens == sorted(lens, reverse=True) and lens[n:] == [0] * (batch - n)


@pytest.mark.parametrize("asked, fp8_cache", [(None, False), ("0", True)])
def test_rows_keep_their_order_over_a_bf16_cache_or_when_asked(monkeypatch, asked, fp8_cache):
    ask_longest_first(monkeypatch, asked)
    off = DecodeBuffers(4, max_blocks=8, max_model_len=32, block_size=BLOCK, device=torch.device("cpu"),
                        fp8_cache=fp8_cache)
    assert off.meta(4).decode_order is None
