"""Sliding-window attention on the GPU: the Triton kernels under CUDA graphs, past the window, give
transformers' greedy tokens (tests/engine/test_model_configs.py checks the same under the interpreter)."""

from __future__ import annotations

import pytest

from nanoserve import LLM
from tests.conftest import _random_model, greedy, hf_greedy, random_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_a_sliding_window_answers_as_transformers_past_the_window_on_the_gpu(tmp_path, enforce_eager):
    # prompts of 90-130 tokens in chunks of 48 (history past the 64-token window), then decode to ~150
    folder = _random_model(tmp_path / "model", "mistral", num_key_value_heads=1, sliding_window=64)
    prompts = random_prompts(3, 384, 90, 130, seed=1)
    with LLM(folder, device="cuda", dtype="float32", attention_backend="triton", max_num_batched_tokens=48,
             max_num_seqs=4, enforce_eager=enforce_eager) as llm:
        assert (llm.engine.runner.graphs is None) == enforce_eager
        ours = greedy(llm, prompts, 20)
    assert ours == hf_greedy(folder, prompts, 20)


def test_sequences_longer_than_the_kv_cache_run_through_their_window_on_the_gpu(tmp_path):
    # blocks of 16 under a 16-key window: the blocks behind it go back to the pool as each sequence moves
    # on, and the graphs read stand-ins in their place; 8 blocks (128 keys) serve three of 130-160 tokens
    folder = _random_model(tmp_path / "model", "mistral", num_key_value_heads=1, sliding_window=16)
    prompts = random_prompts(3, 384, 40, 70, seed=4)
    with LLM(folder, device="cuda", dtype="float32", attention_backend="triton", block_size=16,
             max_num_batched_tokens=32, max_num_seqs=3, num_kvcache_blocks=8, max_model_len=256) as llm:
        ours = greedy(llm, prompts, 90)
        assert llm.engine.block_manager.num_free_blocks == 8
    assert ours == hf_greedy(folder, prompts, 90)
