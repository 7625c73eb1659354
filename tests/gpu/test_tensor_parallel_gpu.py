"""Tensor parallelism over two GPUs (NCCL, CUDA graphs with all-reduces inside): the same greedy
tokens as transformers in float32. Needs a machine with at least two GPUs."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.gpu.conftest import assert_transformers_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_two_gpus_match_transformers(qwen3_06b, enforce_eager):
    prompts = random_prompts(8, 10000, 10, 200, seed=9)
    params = [SamplingParams(temperature=0, max_tokens=33 + i, ignore_eos=True) for i in range(len(prompts))]
    with LLM(qwen3_06b, dtype="float32", device="cuda", tensor_parallel_size=2, max_model_len=1024,
             max_num_seqs=8, num_kvcache_blocks=64, enforce_eager=enforce_eager) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_transformers_greedy(qwen3_06b, prompts, ours)
