"""Prompt logprobs travel packed: a sequence's buffer fills chunk by chunk (again in place after a
preemption), its first output carries the whole prompt's arrays, and the engine's codec moves them
between processes unchanged."""

from __future__ import annotations

import numpy as np

from nanoserve.engine.messages import EngineOutputs, EngineStats, StepOutput, output_decoder, output_encoder
from nanoserve.engine.prompt_logprobs import PromptLogprobBuffer, PromptLogprobs
from nanoserve.runner.batch import PromptScores

TOP = 3


def random_scores(rows: int, top_n: int = TOP, seed: int = 0) -> PromptScores:
    rng = np.random.default_rng(seed)
    top = np.sort(-rng.exponential(3.0, (rows, top_n)).astype(np.float32), axis=1)[:, ::-1]
    return PromptScores(-rng.exponential(3.0, rows).astype(np.float32), rng.integers(1, 4096, rows, dtype=np.int32),
                        rng.integers(0, 4096, (rows, top_n), dtype=np.int32), np.ascontiguousarray(top))


def rows_of(scores: PromptScores, start: int, end: int) -> PromptScores:
    return PromptScores(scores.logprobs[start:end], scores.ranks[start:end], scores.top_ids[start:end],
                        scores.top_logprobs[start:end])


def test_a_prompt_scored_in_chunks_and_again_after_a_preemption_packs_as_scored_at_once():
    num_prompt_tokens = 70
    whole = random_scores(num_prompt_tokens - 1)
    at_once = PromptLogprobBuffer(num_prompt_tokens, TOP)
    at_once.write(0, whole)
    chunked = PromptLogprobBuffer(num_prompt_tokens, TOP)
    chunked.write(0, random_scores(32, seed=1))   # scored before a preemption, with other numbers
    chunked.write(32, random_scores(10, seed=2))
    for start in range(0, num_prompt_tokens - 1, 32):   # the recompute, in chunks of 32 tokens
        chunked.write(start, rows_of(whole, start, min(start + 32, num_prompt_tokens - 1)))
    assert chunked.packed() == at_once.packed()
    packed = chunked.packed()
    assert len(packed) == num_prompt_tokens - 1
    np.testing.assert_array_equal(packed.logprobs, whole.logprobs)
    np.testing.assert_array_equal(packed.ranks, whole.ranks)
    np.testing.assert_array_equal(packed.top_ids, whole.top_ids)
    np.testing.assert_array_equal(packed.top_logprobs, whole.top_logprobs)


def test_the_step_message_carries_the_arrays_through_the_codec_unchanged():
    buffer = PromptLogprobBuffer(40, TOP)
    buffer.write(0, random_scores(39))
    packed = buffer.packed()
    message = EngineOutputs([StepOutput("r", [5], None, False, None, 40, 0, packed),
                             StepOutput("s", [6], None, False, None, 3, 0)], EngineStats())
    decoded = output_decoder.decode(output_encoder.encode(message))
    first, second = decoded.outputs
    assert isinstance(first.prompt_logprobs, PromptLogprobs) and first.prompt_logprobs == packed
    assert second.prompt_logprobs is None
    np.testing.assert_array_equal(first.prompt_logprobs.top_ids, packed.top_ids)
    assert first.prompt_logprobs.nbytes == 39 * (4 + 4 + TOP * 8)


def test_the_listed_form_has_python_floats_of_the_float32_values_and_cuts_alternatives():
    buffer = PromptLogprobBuffer(4, TOP)
    scores = random_scores(3)
    buffer.write(0, scores)
    entries = buffer.packed().entries()
    assert entries[0] is None and len(entries) == 4
    for row, (chosen, alternatives, rank) in enumerate(entries[1:]):
        assert type(chosen) is float and chosen == float(scores.logprobs[row])
        assert type(rank) is int and rank == scores.ranks[row]
        assert alternatives == [(int(i), float(v)) for i, v in zip(scores.top_ids[row], scores.top_logprobs[row])]
    assert [len(e[1]) for e in buffer.packed().entries(top_n=1)[1:]] == [1, 1, 1]


def test_a_one_token_prompt_and_top_0_pack_empty_arrays():
    packed = PromptLogprobBuffer(1, 0).packed()
    assert len(packed) == 0 and packed.entries() == [None]
    buffer = PromptLogprobBuffer(3, 0)
    buffer.write(0, random_scores(2, top_n=0))
    assert buffer.packed().top_ids.shape == (2, 0)
    assert [e[1] for e in buffer.packed().entries()[1:]] == [[], []]
