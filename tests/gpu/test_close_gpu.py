"""A closed LLM gives its device memory back: the next one in the process sizes its KV cache by what
is free, and found none while captured graphs' cycles held the last one's cache (vLLM's users build
one LLM after another in a notebook or a test session)."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.conftest import _random_model

pytestmark = pytest.mark.gpu


def test_a_closed_llm_gives_its_device_memory_back(tmp_path):
    folder = _random_model(tmp_path / "model", "qwen3")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(folder, device="cuda", max_model_len=256, gpu_memory_utilization=0.5) as first:
        first.generate([[1, 2, 3]], params, use_tqdm=False)
        blocks = first.engine.block_manager.num_blocks
    # `first` is still referenced here: close() alone must have let go of the cache and the graphs
    with LLM(folder, device="cuda", max_model_len=256, gpu_memory_utilization=0.5) as second:
        assert second.engine.block_manager.num_blocks >= 0.95 * blocks
        assert len(second.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids) == 8
