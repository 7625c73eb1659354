"""The time bound on grammar matchers (engine/grammar_time.py): a grammar that grows slower token by
token ends its own request, and the others run on."""

from __future__ import annotations

import pytest

from nanoserve.config import DEFAULT_MODEL, EngineConfig
from nanoserve.engine.grammar_time import MatcherClock
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured_outputs_params import StructuredOutputsParams
from tests.engine.test_grammar_state import run

# parses a run of letters and spaces in ever more ways: xgrammar's Earley parser slows with each token
AMBIGUOUS = StructuredOutputsParams(grammar='root ::= x "END"\nx ::= [a-z ] | x x | x " " x')


class Work:
    """A fake matcher whose work advances a fake clock by its cost."""

    def __init__(self, clock: list[float], cost: float) -> None:
        self.clock, self.cost, self.grammar = clock, cost, None

    def __call__(self) -> None:
        self.clock[0] += self.cost


def test_a_slow_batch_times_its_matchers_alone_and_names_the_slow_one():
    now = [0.0]
    clock = MatcherClock(limit_s=0.1, row_allowance_s=0.001, clock=lambda: now[0], wall=lambda: now[0])
    fast, slow = Work(now, 0.01), Work(now, 0.2)
    alone_calls: list[int] = []

    def alone(m: Work, i: int) -> None:
        alone_calls.append(i)
        m()

    def together(ms: list[Work], rows: list[int]) -> None:
        now[0] += max(m.cost for m in ms)   # one batch on parallel threads: its slowest matcher's time

    clock.run([fast, slow], alone, together, closes_step=True)
    assert not clock.slow and set(clock.suspects) == {id(fast), id(slow)} and not alone_calls
    clock.run([fast, slow], alone, together, closes_step=False)     # accept: each alone now
    clock.run([fast, slow], alone, together, closes_step=True)      # fill: accept + fill judged
    assert alone_calls == [0, 1, 0, 1]
    assert list(clock.slow) == [id(slow)] and clock.slow[id(slow)][1] == pytest.approx(0.4)   # its accept and fill

    class Seq:
        def __init__(self, grammar, name):
            self.grammar, self.request_id, self.num_output_tokens = grammar, name, 7
    ended: list[tuple[str, str]] = []
    clock.end_slow([Seq(fast, "a"), Seq(slow, "b"), Seq(None, "c")], lambda s, why: ended.append((s.request_id, why)))
    assert [name for name, _ in ended] == ["b"] and "took 400 ms to follow one token" in ended[0][1]
    assert not clock.slow and id(slow) not in clock.suspects


def test_accept_and_fill_of_one_step_add_up_and_a_lone_row_is_judged_at_once():
    now = [0.0]
    clock = MatcherClock(limit_s=0.1, row_allowance_s=0.0, clock=lambda: now[0], wall=lambda: now[0])
    half = Work(now, 0.06)
    clock.suspects[id(half)] = 0.0
    call = lambda m, i: m()   # noqa: E731
    clock.run([half], call, call, closes_step=False)
    assert not clock.slow
    clock.run([half], call, call, closes_step=True)
    assert id(half) in clock.slow   # 60 ms to accept + 60 ms to fill
    lone = Work(now, 0.15)
    clock.run([lone], call, lambda ms, rows: ms[0](), closes_step=True)
    assert id(lone) in clock.slow   # a batch of one row: its time is its own


def test_the_slowest_of_suspects_slow_only_together_are_named_until_the_rest_fit():
    # 16 ambiguous requests (72 rows) each under the bound alone held a plain request to 34 s
    now = [0.0]
    clock = MatcherClock(limit_s=0.1, row_allowance_s=0.0, clock=lambda: now[0], wall=lambda: now[0])
    works = [Work(now, cost) for cost in (0.04, 0.03, 0.03, 0.02, 0.001)]
    for w in works:
        clock.suspects[id(w)] = 0.0
    call = lambda m, i: m()   # noqa: E731
    clock.run(works, call, call, closes_step=True)   # 121 ms together: the 40 ms one goes, 81 ms stay
    assert list(clock.slow) == [id(works[0])]
    clock.slow.clear()
    clock.run(works[1:], call, call, closes_step=True)   # 81 ms together: within the bound
    assert not clock.slow


def test_an_ambiguous_grammar_is_ended_while_the_other_requests_complete():
    engine = LLMEngine(EngineConfig(DEFAULT_MODEL, device="cpu", num_kvcache_blocks=128, block_size=16))
    try:
        prompt = engine.tokenizer.encode("The letters are")
        engine.add_request("ambiguous", prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=400,
                                                               structured_outputs=AMBIGUOUS))
        engine.add_request("plain", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        engine.add_request("regex", prompt, SamplingParams(temperature=0, max_tokens=30, min_tokens=30,
                                                           structured_outputs=StructuredOutputsParams(regex="[a-z ]*")))
        tokens, reasons, errors = run(engine)
    finally:
        engine.close()
    assert sorted(errors) == ["ambiguous"] and "(at most 100 ms, alone or together)" in errors["ambiguous"]
    assert len(tokens["ambiguous"]) < 400 and "ambiguous" not in reasons
    assert reasons == {"plain": "length", "regex": "length"} and len(tokens["regex"]) == 30
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.sequences
