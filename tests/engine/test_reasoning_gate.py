"""A grammar that waits for the reasoning's end: free while the model reasons, held after it."""

from __future__ import annotations

import re

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.config import DEFAULT_MODEL
from nanoserve.engine.reasoning_gate import ReasoningGate
from nanoserve.structured_outputs_params import StructuredOutputsParams

PROMPTS = ["The function returns", "A list is"]
DIGITS = r"[0-9]{3}"


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request):
    with LLM(DEFAULT_MODEL, device="cpu", num_kvcache_blocks=256, block_size=16,
             async_scheduling=request.param) as model:
        yield model


@pytest.fixture(scope="module")
def tags(llm) -> tuple[int, int, int]:
    """Three ordinary tokens that no digit regex admits: a reasoning start, its end, another."""
    ids = [i for i in range(100, 4000) if not re.search(r"[0-9]", llm.tokenizer.decode([i]))]
    return ids[0], ids[1], ids[2]


def text(model: LLM, token_ids: list[int]) -> str:
    return model.tokenizer.decode(token_ids, skip_special_tokens=True).strip()   # the grammar's stop token aside


def outputs(model: LLM, spec: StructuredOutputsParams, n: int = 1, **sampling) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=12, n=n, structured_outputs=spec, **sampling)
    return [c for out in model.generate(PROMPTS, params, use_tqdm=False) for c in out.outputs]


def test_after_the_reasoning_ends_the_answer_follows_the_grammar(llm, tags):
    """The prompt opened the reasoning; the end token (pushed by a bias) closes it at once, and the
    same bias cannot put it in the answer, which the grammar holds to three digits."""
    _, end, _ = tags
    spec = StructuredOutputsParams(regex=DIGITS, reasoning_end_id=end, reasoning_open=True)
    for choice in outputs(llm, spec, n=2, logit_bias={end: 100.0}):
        assert choice.token_ids[0] == end
        assert re.fullmatch(DIGITS, text(llm, choice.token_ids[1:])), choice.token_ids
        assert choice.finish_reason == "stop"   # the grammar completed


def test_while_reasoning_any_token_may_come(llm, tags):
    _, end, other = tags
    spec = StructuredOutputsParams(regex=DIGITS, reasoning_end_id=end, reasoning_open=True)
    for choice in outputs(llm, spec, logit_bias={other: 100.0}):
        assert choice.token_ids == [other] * 12 and choice.finish_reason == "length"
    held = StructuredOutputsParams(regex=DIGITS)   # the same request without the gate: digits at once
    for choice in outputs(llm, held, logit_bias={other: 100.0}):
        assert re.fullmatch(DIGITS, text(llm, choice.token_ids))


def test_the_first_token_may_open_the_reasoning_or_start_the_answer(llm, tags):
    start, end, other = tags
    spec = StructuredOutputsParams(regex=DIGITS, reasoning_start_id=start, reasoning_end_id=end)
    # opened by its first token, the output reasons freely (no digit after it)
    opened = outputs(llm, spec, logit_bias={start: 100.0})
    assert all(c.token_ids == [start] * 12 for c in opened)
    # not opened: the grammar holds from the first token (the start token is allowed only there)
    for choice in outputs(llm, spec, logit_bias={start: -100.0, other: 100.0}):
        assert re.fullmatch(DIGITS, text(llm, choice.token_ids))


def test_bans_and_allow_lists_hold_while_reasoning(llm, tags):
    _, end, other = tags
    spec = StructuredOutputsParams(regex=DIGITS, reasoning_end_id=end, reasoning_open=True)
    for choice in outputs(llm, spec, allowed_token_ids=[other, end], logit_bias={end: 5.0, other: 10.0}):
        assert set(choice.token_ids) == {other}


def test_the_gate_is_per_sequence_and_reads_its_spec():
    spec = StructuredOutputsParams(regex="a", reasoning_start_id=5, reasoning_end_id=6)
    gate = ReasoningGate(spec)
    assert not gate.reasoning and not gate.answering
    assert gate.passes(7) and gate.answering and gate.passes(6)   # answered at once: the grammar takes all
    gate = ReasoningGate(spec)
    assert not gate.passes(5) and gate.reasoning
    assert not gate.passes(5) and not gate.passes(6) and gate.answering
    with pytest.raises(ValueError, match="need reasoning_end_id"):
        StructuredOutputsParams(regex="a", reasoning_open=True)
    with pytest.raises(ValueError, match="must be a token id"):
        StructuredOutputsParams(regex="a", reasoning_end_id=True)
