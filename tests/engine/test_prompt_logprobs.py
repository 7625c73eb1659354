"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' log-softmax at every prompt
position, through chunked prefill, preemption, pipelined scheduling and a warm prefix cache."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.conftest import assert_rank, hf_logprobs, random_prompts

TOP = 3


def assert_matches_hf(model_path: str, prompt: list[int], got: list) -> None:
    expected = hf_logprobs(model_path, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for position, (chosen, top, rank) in enumerate(got[1:]):
        row = expected[position]  # the logits at position p score the token at p + 1
        target = row[prompt[position + 1]].item()
        assert chosen == pytest.approx(target, abs=1e-4)
        assert_rank(row, target, rank)
        values, _ = row.topk(TOP)
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
        # each id named has that value in transformers too (two ids may swap only within a tie)
        assert [row[t].item() for t, _ in top] == pytest.approx([v for _, v in top], abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "pipelined"])
def test_prompt_logprobs_match_hf_through_chunks_and_preemption(random_model, async_scheduling):
    prompts = random_prompts(6, 384, 20, 90, seed=11)
    llm = LLM(random_model, dtype="float32", device="cpu", block_size=8, num_kvcache_blocks=30, max_model_len=128,
              max_num_batched_tokens=32, max_num_seqs=6, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=TOP)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert max(map(len, prompts)) > 32  # every long prompt is scored over several chunks
    for prompt, out in zip(prompts, outputs):
        assert_matches_hf(random_model, prompt, out.outputs[0].prompt_logprobs.entries())
    assert llm.engine.block_manager.num_free_blocks == 30


def test_a_cached_prefix_is_scored_all_the_same(qwen3_model):
    prompt = random_prompts(1, 384, 70, 70, seed=12)[0]
    llm = LLM(qwen3_model, dtype="float32", device="cpu", block_size=16)
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    scored = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=TOP),
                          use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0  # the prompt's blocks were in the cache, and were not used
    assert scored.token_ids == plain.token_ids
    assert_matches_hf(qwen3_model, prompt, scored.outputs[0].prompt_logprobs.entries())


def test_n_choices_score_their_prompt_once_and_share_its_blocks(qwen3_model):
    prompt = random_prompts(1, 384, 70, 70, seed=13)[0]
    llm = LLM(qwen3_model, dtype="float32", device="cpu", block_size=16)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP, n=4)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert_matches_hf(qwen3_model, prompt, out.outputs[0].prompt_logprobs.entries())
    # the siblings start from the first choice's cached prompt, where each once prefilled it anew
    assert out.num_cached_tokens == 64 and len(out.outputs) == 4
    assert all(len(o.token_ids) == 3 for o in out.outputs)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_prompt_logprobs_range_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_max_logprobs_bounds_both_kinds_and_past_20_they_match_hf(qwen3_model):
    """vLLM's max_logprobs: 20 by default, refused past it before anything is queued; raised, the
    alternatives past 20 are transformers' too. The whole vocabulary (vLLM's -1) is not offered."""
    prompt = random_prompts(1, 384, 12, 12, seed=14)[0]
    llm = LLM(qwen3_model, dtype="float32", device="cpu", block_size=16)
    for asked in (dict(logprobs=21), dict(prompt_logprobs=21)):
        with pytest.raises(ValueError, match=f"{next(iter(asked))} asks for 21 alternatives.*at most 20"):
            llm.generate([prompt], SamplingParams(max_tokens=2, **asked), use_tqdm=False)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    wide = LLM(qwen3_model, dtype="float32", device="cpu", block_size=16, max_logprobs=40)
    out = wide.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, logprobs=33, prompt_logprobs=37),
                        use_tqdm=False)[0]
    expected = hf_logprobs(qwen3_model, prompt + out.token_ids)
    for position, entry in enumerate(out.prompt_logprobs[1:]):
        top = sorted(entry.values(), key=lambda lp: lp.rank)[:37]
        assert [lp.rank for lp in top] == list(range(1, 38))
        assert [lp.logprob for lp in top] == pytest.approx(expected[position].topk(37).values.tolist(), abs=1e-4)
    for step, entry in enumerate(out.outputs[0].logprobs):
        top = sorted(entry.values(), key=lambda lp: lp.rank)[:33]
        assert [lp.logprob for lp in top] == pytest.approx(expected[len(prompt) - 1 + step].topk(33).values.tolist(),
                                                           abs=1e-4)
    with pytest.raises(ValueError, match="max_logprobs must be an integer in 0-1024"):
        LLM(qwen3_model, dtype="float32", device="cpu", max_logprobs=-1)
