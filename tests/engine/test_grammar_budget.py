"""A real engine under a small budget of grammars in use: distinct grammars take turns, each
output still matches its grammar, a plain request does not wait behind them, and nothing leaks."""

from __future__ import annotations

import random
import re
import string

import pytest

from nanoserve.config import DEFAULT_MODEL, EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured_outputs_params import StructuredOutputsParams

WORDS = 400   # 12-letter words: ~5 KiB of regex, ~0.9 MB compiled for the bundled tokenizer
BUDGET = 2 << 20   # two such grammars at a time


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(EngineConfig(DEFAULT_MODEL, device="cpu", num_kvcache_blocks=128, block_size=16,
                                    max_grammar_bytes=BUDGET))
    yield engine
    engine.close()


def word_regex(rng: random.Random) -> str:
    return "(" + "|".join("".join(rng.choice(string.ascii_lowercase) for _ in range(12)) for _ in range(WORDS)) + ")"


def run(engine: LLMEngine, limit: int = 2000) -> dict[str, list[int]]:
    """Step until idle; each request's output tokens. Checks the budget after every step."""
    tokens: dict[str, list[int]] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert engine.grammar_queue.budget.bytes <= BUDGET
    raise AssertionError("the engine did not finish")


def test_distinct_grammars_wait_for_room_while_a_plain_request_runs(engine):
    rng = random.Random(0)
    regexes = [word_regex(rng) for _ in range(6)]
    prompt = engine.tokenizer.encode("The function returns")
    for i, regex in enumerate(regexes):
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex))
        engine.add_request(f"g{i}", prompt, params, fork_ids=(f"g{i}-fork",) if i == 0 else ())
    engine.add_request("plain", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    # the last one arrived after the plain request and waits for room: it is aborted there
    engine.add_request("gone", prompt, SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        regex=word_regex(rng))))

    tokens: dict[str, list[int]] = {}
    waited, queued_when_plain_done = False, None
    # how far the compiles are when the plain request ends depends on the CPU's load: step on
    # until a compiled grammar has been seen waiting for room too
    for _ in range(2000):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        waited |= any(e.future is not None and e.future.done() for e in engine.grammar_queue.waiting)
        if queued_when_plain_done is None and len(tokens.get("plain", [])) == 4:
            queued_when_plain_done = len(engine.grammar_queue)
        if waited and queued_when_plain_done is not None:
            break
    # the plain request is done while grammars still wait (it never queued behind them), and
    # compiled grammars wait for room under the budget
    assert waited and queued_when_plain_done is not None and queued_when_plain_done >= 2
    assert engine.abort_request("gone")
    tokens.update({k: tokens.get(k, []) + v for k, v in run(engine).items()})

    budget = engine.grammar_queue.budget
    assert 0 < budget.peak <= BUDGET and budget.bytes == 0 and len(budget) == 0
    for i, regex in enumerate(regexes):
        text = engine.tokenizer.decode(tokens[f"g{i}"], skip_special_tokens=True)
        assert re.fullmatch(regex, text), f"g{i}: {text!r}"
    assert engine.tokenizer.decode(tokens["g0-fork"], skip_special_tokens=True) in regexes[0]
    assert "gone" not in tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.sequences and not engine.grammar_queue and not engine.grammar_queue._holding


def test_one_grammar_larger_than_the_budget_runs_alone(engine):
    rng = random.Random(1)
    huge = "(" + "|".join("".join(rng.choice(string.ascii_lowercase) for _ in range(12)) for _ in range(1200)) + ")"
    prompt = engine.tokenizer.encode("A list is")
    for i, regex in enumerate([word_regex(rng), huge, word_regex(rng)]):
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex))
        engine.add_request(f"r{i}", prompt, params)
    tokens = {}
    peak_alone = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        held = engine.grammar_queue.budget.bytes
        if held > BUDGET:   # only the huge one may pass the budget, and only alone
            assert len(engine.grammar_queue.budget) == 1
            peak_alone = max(peak_alone, held)
    assert peak_alone > BUDGET and sorted(tokens) == ["r0", "r1", "r2"]
    assert engine.grammar_queue.budget.bytes == 0
