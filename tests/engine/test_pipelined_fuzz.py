"""Pipelined steps under everything that moves sequences about: priorities that preempt, n > 1
siblings sharing blocks, aborts, grammars, stop tokens and a cache of 20 blocks. Whatever the
interleaving, the runner never gets a token the host does not know yet except as the first new
token of a decode (read on the device from the step before), and the engine ends with every
block free."""

from __future__ import annotations

import random

from nanoserve.config import DEFAULT_MODEL, EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.runner.batch import PENDING_TOKEN
from nanoserve.runner.model_runner import ModelRunner
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured_outputs_params import StructuredOutputsParams
from tests.conftest import _random_model


def checked_forward(forward, ref_counts: list[int] | None = None):
    """The runner's forward, checking each step's work first; with the block manager's ref_counts,
    also that every block-table entry names a block some sequence holds."""
    def check(self, work):
        for w in work:
            chunk = w.token_ids[w.start:w.start + w.num_new]
            in_flight = w.prev_row >= 0
            assert PENDING_TOKEN not in chunk[1 if in_flight else 0:], (w.start, w.num_new, len(w.token_ids))
            assert not in_flight or (w.num_new == 1 and chunk[0] == PENDING_TOKEN), (w.start, w.num_new, chunk[:3])
            assert ref_counts is None or all(ref_counts[b] > 0 for b in w.block_table), w.block_table
            check.stand_ins += len(set(w.block_table)) < len(w.block_table)
        return forward(self, work)
    check.stand_ins = 0   # tables naming a block twice: blocks given back behind a sliding window
    return check


def random_params(rng: random.Random, prompt_len: int) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, max_tokens=rng.randint(1, 60), ignore_eos=rng.random() < 0.5,
        prompt_logprobs=2 if rng.random() < 0.1 else None,
        structured_outputs=(StructuredOutputsParams(regex="[a-z ]{0,%d}" % rng.randint(1, 60))
                            if rng.random() < 0.2 else None),
        stop_token_ids=[rng.randint(5, 300)] if rng.random() < 0.3 else [])


def churn(engine: LLMEngine, rng: random.Random, vocab: int) -> None:
    """160 rounds of arrivals (some with siblings), aborts and steps, then steps until all is done."""
    live: list[str] = []
    try:
        for k in range(160):
            if rng.random() < 0.25:
                n = rng.randint(3, 100)
                forks = [f"r{k}-{c}" for c in range(1, rng.choice([1, 1, 2, 4]))]
                engine.add_request(f"r{k}", [rng.randint(5, vocab - 1) for _ in range(n)], random_params(rng, n),
                                   forks, priority=rng.randint(-3, 3))
                live += [f"r{k}", *forks]
            elif rng.random() < 0.15 and live:
                engine.abort_request(live.pop(rng.randrange(len(live))))
            if engine.has_unfinished_requests():
                engine.step()
            engine.take_failures()
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.close()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.sequences


def test_pipelined_priority_scheduling_never_sends_the_runner_an_unknown_token(monkeypatch, seed=1):
    monkeypatch.setattr(ModelRunner, "forward", checked_forward(ModelRunner.forward))
    engine = LLMEngine(EngineConfig(DEFAULT_MODEL, device="cpu", num_kvcache_blocks=20, block_size=16,
                                    max_model_len=256, scheduling_policy="priority", async_scheduling=True,
                                    max_num_seqs=16))
    churn(engine, random.Random(seed), 3000)
    assert engine.scheduler.num_preemptions > 10


def test_pipelined_steps_over_a_sliding_window_name_only_held_blocks(monkeypatch, tmp_path, seed=2):
    # every layer slides over 24 keys: sequences give back the blocks behind it between steps placed
    # ahead of their tokens, while preempted, aborted, forked; 12 blocks for up to 16 sequences
    folder = _random_model(tmp_path / "model", "mistral", num_key_value_heads=1, sliding_window=24)
    engine = LLMEngine(EngineConfig(folder, device="cpu", num_kvcache_blocks=12, block_size=16, max_model_len=256,
                                    max_num_batched_tokens=64, scheduling_policy="priority",
                                    async_scheduling=True, max_num_seqs=16))
    forward = checked_forward(ModelRunner.forward, engine.block_manager.ref_counts)
    monkeypatch.setattr(ModelRunner, "forward", forward)
    churn(engine, random.Random(seed), 384)
    assert engine.scheduler.num_preemptions > 10 and forward.stand_ins > 100
