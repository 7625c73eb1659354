"""Prefill steps replayed from CUDA graphs give transformers' greedy tokens in float32: prompts
alone and a few at a time, chunked (a chunk's history in the cache), with prefix-cache hits, and
mixed with decode rows."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from nanoserve import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.gpu.conftest import assert_transformers_greedy

pytestmark = pytest.mark.gpu


def record_stages(llm: LLM, what: Callable[[list, bool], object]) -> list:
    """What `what(work, split)` says of each step the prefill graphs stage from now on."""
    buffers = llm.engine.runner.prefill_graphs.buffers
    seen, stage = [], buffers.stage

    def recorded(work, *args, **kwargs):
        out = stage(work, *args, **kwargs)
        seen.append(what(work, out[2]))
        return out

    buffers.stage = recorded
    return seen


def greedy(llm: LLM, prompts: list[list[int]], tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("max_num_seqs", [1, 4, 32], ids=["alone", "a-few", "beside-decode-rows"])
def test_graphed_prefill_gives_transformers_greedy_tokens(qwen3_06b, max_num_seqs):
    # 300-token chunks: longer prompts prefill over several graphed steps, each over its history
    llm = LLM(qwen3_06b, dtype="float32", device="cuda", max_model_len=1024, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=300, num_kvcache_blocks=64, prefill_cuda_graphs=True)
    runner = llm.engine.runner
    assert runner.prefill_graphs is not None and runner.prefill_graphs.max_tokens == 300
    replays = 0
    run = runner.prefill_graphs.run

    def counted(*args, **kwargs):
        nonlocal replays
        replays += 1
        return run(*args, **kwargs)

    runner.prefill_graphs.run = counted
    prompts = random_prompts(6, 10000, 5, 700, seed=11)
    prompts += random_prompts(2, 10000, 20, 60, seed=12, shared_prefix=600)   # alone, the second finds 512 keys cached
    ours = greedy(llm, prompts)
    assert replays >= len(prompts)
    assert_transformers_greedy(qwen3_06b, prompts, ours)
    llm.close()



def test_a_turn_after_a_cached_history_is_split_and_gives_transformers_greedy_tokens(qwen3_06b):
    # each prompt adds 20-100 tokens to a shared 3,000-token history found in the prefix cache: a
    # few programs over all of it, which the graphs split (prefill_splits.py) and merge
    llm = LLM(qwen3_06b, dtype="float32", device="cuda", max_model_len=4096, max_num_seqs=1,
              num_kvcache_blocks=64, prefill_cuda_graphs=True)
    splits = record_stages(llm, lambda work, split: split)
    prompts = random_prompts(4, 10000, 20, 100, seed=21, shared_prefix=3000)
    ours = greedy(llm, prompts)
    assert sum(splits) >= 3   # the first prompt computes the history; the others only their own tokens
    assert_transformers_greedy(qwen3_06b, prompts, ours)
    llm.close()


def test_a_turn_after_a_cached_history_beside_a_running_stream_is_split_and_gives_transformers_greedy_tokens(
        qwen3_06b):
    # two at a time, the first of each pair ending sooner: each later turn is admitted beside the
    # other's decode row, a mixed step whose prompt's keys the mixed split graph splits
    llm = LLM(qwen3_06b, dtype="float32", device="cuda", max_model_len=4096, max_num_seqs=2,
              num_kvcache_blocks=64, prefill_cuda_graphs=True)
    mixed_splits = record_stages(llm, lambda work, split: split and any(w.num_new == 1 for w in work))
    prompts = random_prompts(5, 10000, 20, 100, seed=22, shared_prefix=3000)
    ours = greedy(llm, prompts[:1])   # computes the history, which the prefix cache then holds
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 30, 30, 30)]
    ours += [o.token_ids for o in llm.generate(prompts[1:], params, use_tqdm=False)]
    assert sum(mixed_splits) >= 2
    assert_transformers_greedy(qwen3_06b, prompts, ours)
    llm.close()


def test_a_card_too_full_for_the_cache_names_the_prefill_graphs_memory(qwen3_06b):
    with pytest.raises(ValueError, match=r"--no-prefill-cuda-graphs\), which frees \d+\.\d\d GiB"):
        LLM(qwen3_06b, device="cuda", max_model_len=1024, gpu_memory_utilization=0.01)
