"""An fp8 checkpoint loaded onto the GPU is the model of its widened weights: the same greedy tokens, in
float32 and bf16, through the CUDA graphs, as the plain checkpoint that holds those weights."""

from __future__ import annotations

import pytest

from nanoserve import LLM
from tests.conftest import greedy, random_prompts
from tests.runner.test_fp8_checkpoint import fp8_folders

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["fp8-blocks", "compressed-tensors-channel"])
def test_an_fp8_checkpoint_on_the_gpu_answers_as_its_widened_weights(tmp_path, qwen3_model, per_channel, dtype):
    quantized, reference, _ = fp8_folders(qwen3_model, tmp_path, per_channel)
    prompts = random_prompts(8, 384, 10, 300, seed=11)
    answers = []
    for folder in (quantized, reference):
        with LLM(folder, dtype=dtype, device="cuda", max_model_len=512, max_num_seqs=8,
                 num_kvcache_blocks=64) as llm:
            answers.append(greedy(llm, prompts, 24))
    assert answers[0] == answers[1]
