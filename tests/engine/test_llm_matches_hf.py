"""Greedy outputs equal transformers token for token (CPU, float32), under every scheduling path."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_batch_of_mixed_lengths_matches_hf(random_model):
    prompts = random_prompts(10, 384, 3, 60, seed=1)
    llm = LLM(random_model, dtype="float32", device="cpu")
    assert generate(llm, prompts) == hf_greedy(random_model, prompts, GREEDY.max_tokens)


def test_prefix_caching_hits_and_still_matches_hf(qwen3_model):
    prompts = random_prompts(8, 384, 5, 20, seed=2, shared_prefix=70)
    llm = LLM(qwen3_model, dtype="float32", device="cpu", block_size=16)
    expected = hf_greedy(qwen3_model, prompts, GREEDY.max_tokens)
    assert generate(llm, prompts[:1]) == expected[:1]
    hits_before = llm.engine.block_manager.prefix_hit_tokens
    assert generate(llm, prompts[1:]) == expected[1:]
    # each later prompt finds at least the 4 full blocks of the shared 70-token prefix
    assert llm.engine.block_manager.prefix_hit_tokens - hits_before >= 7 * 64


def test_chunked_prefill_matches_hf(qwen3_model):
    prompts = random_prompts(8, 384, 40, 150, seed=3)
    llm = LLM(qwen3_model, dtype="float32", device="cpu", max_num_batched_tokens=32, max_num_seqs=4,
              enable_prefix_caching=False)
    assert max(map(len, prompts)) > 32
    assert generate(llm, prompts) == hf_greedy(qwen3_model, prompts, GREEDY.max_tokens)


def test_preemption_matches_hf(qwen3_model):
    prompts = random_prompts(8, 384, 30, 60, seed=4)
    # 40 blocks of 8 tokens hold about 4 of these sequences at full length: the rest must wait or be preempted
    llm = LLM(qwen3_model, dtype="float32", device="cpu", block_size=8, num_kvcache_blocks=40,
              max_model_len=256)
    assert generate(llm, prompts) == hf_greedy(qwen3_model, prompts, GREEDY.max_tokens)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 40


def test_prompt_longer_than_context_is_rejected(qwen3_model):
    llm = LLM(qwen3_model, dtype="float32", device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match="64"):
        llm.generate([[5] * 64], GREEDY, use_tqdm=False)


def test_bundled_model_matches_hf():
    from nanoserve import DEFAULT_MODEL

    llm = LLM(dtype="float32", device="cpu")
    texts = ["The function returns", "A list is", "In Python, a class", "import os\n", "Return the number of",
             "If the", "The default value of the argument", "Raise"]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=32)  # eos on: both sides stop at the same token
    outputs = llm.generate(texts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(DEFAULT_MODEL, prompts, 32, stop_at_eos=True)
    assert all(o.text for o in outputs)


def test_async_scheduling_matches_hf_through_chunking_and_preemption(random_model):
    """Launching step N+1 before step N's ids are read changes nothing in the tokens."""
    prompts = random_prompts(10, 384, 20, 90, seed=5)
    llm = LLM(random_model, dtype="float32", device="cpu", block_size=8, num_kvcache_blocks=40, max_model_len=256,
              max_num_batched_tokens=48, max_num_seqs=8, async_scheduling=True)
    assert generate(llm, prompts) == hf_greedy(random_model, prompts, GREEDY.max_tokens)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 40


def test_async_scheduling_stops_like_sync_on_the_bundled_model():
    texts = ["The function returns", "A list is", "If the", "Raise", "Return the number of", "import os\n"]
    cases = [SamplingParams(temperature=0.0, max_tokens=40),                      # eos stops
             SamplingParams(temperature=0.0, max_tokens=40, stop=["."]),          # stop strings abort
             # penalties: a pipelined step counts the pending token on the device
             SamplingParams(temperature=0.8, seed=3, max_tokens=20, presence_penalty=0.5),
             SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.4),
             SamplingParams(temperature=0.0, max_tokens=30, n=2)]                 # forks
    sync = LLM(dtype="float32", device="cpu")
    pipelined = LLM(dtype="float32", device="cpu", async_scheduling=True)
    for params in cases:
        want = sync.generate(texts, params, use_tqdm=False)
        got = pipelined.generate(texts, params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
        assert [o.text for o in got] == [o.text for o in want]
    assert pipelined.engine.block_manager.num_free_blocks == pipelined.engine.block_manager.num_blocks
    assert not pipelined.engine.has_unfinished_requests()


def test_penalized_steps_are_pipelined():
    """Penalties need no token read back: a penalized step is launched before the last one is read."""
    llm = LLM(dtype="float32", device="cpu", async_scheduling=True)
    engine, real_step, overlapped = llm.engine, llm.engine.step, []

    def step():
        outputs = real_step()
        overlapped.append(engine.in_flight is not None and
                          any(seq.params.uses_penalties for seq in engine.in_flight.sequences))
        return outputs

    engine.step = step
    llm.generate(["The function returns", "A list is"],
                 SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.2),
                 use_tqdm=False)
    assert sum(overlapped) >= 25


def test_penalty_counts_kept_between_steps_give_the_tokens_of_a_fresh_count(qwen3_model):
    """Through chunking, preemption, forks and pipelining, penalties from the counts the runner
    keeps per sequence pick the same tokens as counting every row's whole history each step.
    The counts are the runner's and the sampler's, the same for every architecture: one model."""
    prompts = random_prompts(10, 384, 20, 90, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.4, presence_penalty=0.3, n=1 + i % 2) for i in range(len(prompts))]
    outputs = []
    for keep in (True, False):
        llm = LLM(qwen3_model, dtype="float32", device="cpu", block_size=8, num_kvcache_blocks=40,
                  max_model_len=256, max_num_batched_tokens=48, max_num_seqs=8, async_scheduling=True)
        if not keep:
            llm.engine.runner.penalty_counts = None   # counted afresh at every step
        outputs.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.engine.scheduler.num_preemptions > 0
    assert outputs[0] == outputs[1]


def test_cached_tokens_never_exceed_the_prompt_through_preemption(qwen3_model):
    """A preempted sequence is admitted again with its outputs, and the prefix cache may then hold
    more of it than its prompt: only prompt tokens are reported cached (usage's cached_tokens
    was 272 for a prompt of 244 tokens)."""
    prompts = random_prompts(8, 384, 30, 60, seed=0)
    llm = LLM(qwen3_model, dtype="float32", device="cpu", block_size=8, num_kvcache_blocks=40,
              max_model_len=256)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    seen = []
    while llm.engine.has_unfinished_requests():
        seen += [(step.num_cached_tokens, step.num_prompt_tokens) for step in llm.engine.step()]
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(cached for cached, _ in seen)   # readmissions found their blocks
    assert all(cached <= prompt for cached, prompt in seen)
