"""A real engine under a small limit of grammar state: a structured-output request whose matcher
grows with every token is ended with an error, a plain request beside it completes, nothing leaks."""

from __future__ import annotations

import pytest

from nanoserve.config import DEFAULT_MODEL, EngineConfig
from nanoserve.engine.grammar_state import GrammarStateGuard
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured_outputs_params import StructuredOutputsParams

LIMIT = 2_000_000
PER_TOKEN = 100_000   # what the fake probe charges per token a live matcher has accepted
GROWING = StructuredOutputsParams(regex="[a-z]{0,5000}")


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(EngineConfig(DEFAULT_MODEL, device="cpu", num_kvcache_blocks=128, block_size=16,
                                    max_grammar_state_bytes=LIMIT))
    # the process's real memory moves with everything else in a test run: the engine's own
    # accounting is checked against a memory that grows only with matchers' accepted tokens
    # (real growth, ~8.5 KB a token for this grammar, is measured in grammar_state.py's docstring)
    engine.grammar_state.probe = lambda: 10**9 + PER_TOKEN * sum(
        s.num_output_tokens for s in engine.sequences.values() if s.grammar is not None)
    engine.grammar_state.trim = lambda: None
    yield engine
    engine.close()


def run(engine: LLMEngine, limit: int = 1000) -> tuple[dict[str, list[int]], dict[str, str], dict[str, str]]:
    """Step until idle: each request's output tokens, finish reasons, and errors of those ended."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    errors: dict[str, str] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return tokens, reasons, errors
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        for ids, why in engine.take_failures():
            errors.update(dict.fromkeys(ids, why))
    raise AssertionError("the engine did not finish")


def test_a_growing_grammar_is_ended_while_a_plain_request_completes(engine):
    prompt = engine.tokenizer.encode("The letters are")
    # min_tokens, not ignore_eos: the grammar may end at any letter, and with ignore_eos it still
    # ends on the tokenizer's eos (which the tiny model picks after ~30 letters)
    engine.add_request("grows", prompt, SamplingParams(temperature=0, max_tokens=100, min_tokens=100,
                                                       structured_outputs=GROWING))
    engine.add_request("plain", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.add_request("small", prompt, SamplingParams(temperature=0, max_tokens=5, min_tokens=5,
                                                       structured_outputs=StructuredOutputsParams(regex="[a-z ]*")))
    tokens, reasons, errors = run(engine)

    assert "--max-grammar-state-bytes" in errors["grows"] and "grows" not in reasons
    assert sorted(errors) == ["grows"] and 10 <= len(tokens["grows"]) < 100
    assert reasons == {"plain": "length", "small": "length"} and len(tokens["plain"]) == 40
    assert engine.grammar_state.peak_growth > LIMIT
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert engine.grammar_queue.budget.bytes == 0 and not engine.grammar_queue._holding
    assert not engine.sequences and not engine.grammar_queue


def test_the_guard_ends_the_largest_holders_until_under_the_limit():
    class Seq:
        def __init__(self, n: int, grammar: object | None) -> None:
            self.num_output_tokens, self.grammar = n, grammar

    memory = [100]
    guard = GrammarStateGuard(50, probe=lambda: memory[0], trim=lambda: None)
    seqs = [Seq(10, "g"), Seq(900, None), Seq(30, "g"), Seq(20, "g")]
    ended = []

    def end(seq, why):
        ended.append(seq.num_output_tokens)
        seq.grammar = None
        memory[0] -= 40   # each ended matcher gives back 40

    guard.enforce(False, 0, seqs, end)   # nothing held: the baseline (100)
    memory[0] = 220
    guard.enforce(True, 0, seqs, end)
    # 120 over the baseline: the largest holder (30 tokens) goes, then 20 (-> 140, within 50);
    # the plain sequence with the most tokens is never ended
    assert ended == [30, 20, 10][:len(ended)] and memory[0] - 100 <= 50 and ended == [30, 20]
