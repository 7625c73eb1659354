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


def checked_forward(forward):
    def check(self, work):
        for w in work:
            chunk = w.token_ids[w.start:w.start + w.num_new]
            in_flight = w.prev_row >= 0
            assert PENDING_TOKEN not in chunk[1 if in_flight else 0:], (w.start, w.num_new, len(w.token_ids))
            assert not in_flight or (w.num_new == 1 and chunk[0] == PENDING_TOKEN), (w.start, w.num_new, chunk[:3])
        return forward(self, work)
    return check


def random_params(rng: random.Random, prompt_len: int) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, max_tokens=rng.randint(1, 60), ignore_eos=rng.random() < 0.5,
        prompt_logprobs=2 if rng.random() < 0.1 else None,
        structured_outputs=(StructuredOutputsParams(regex="[a-z ]{0,%d}" % rng.randint(1, 60))
                            if rng.random() < 0.2 else None),
        stop_token_ids=[rng.randint(5, 300)] if rng.random() < 0.3 else [])


def test_pipelined_priority_scheduling_never_sends_the_runner_an_unknown_token(monkeypatch, seed=1):
    monkeypatch.setattr(ModelRunner, "forward", checked_forward(ModelRunner.forward))
    rng = random.Random(seed)
    engine = LLMEngine(EngineConfig(DEFAULT_MODEL, device="cpu", num_kvcache_blocks=20, block_size=16,
                                    max_model_len=256, scheduling_policy="priority", async_scheduling=True,
                                    max_num_seqs=16))
    live: list[str] = []
    try:
        for k in range(160):
            if rng.random() < 0.25:
                n = rng.randint(3, 100)
                forks = [f"r{k}-{c}" for c in range(1, rng.choice([1, 1, 2, 4]))]
                engine.add_request(f"r{k}", [rng.randint(5, 3000) for _ in range(n)], random_params(rng, n), forks,
                                   priority=rng.randint(-3, 3))
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
    assert engine.scheduler.num_preemptions > 10
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.sequences
