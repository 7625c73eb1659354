"""The CUDA runner against transformers: exact greedy tokens in float32, close logits in bf16."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.gpu.conftest import assert_transformers_greedy, hf_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("enforce_eager, async_scheduling", [(False, False), (True, False), (False, True)],
                         ids=["cuda-graphs", "eager", "cuda-graphs-async"])
def test_float32_greedy_matches_transformers(qwen3_06b, enforce_eager, async_scheduling):
    prompts = random_prompts(16, 10000, 10, 200, seed=7)
    llm = LLM(qwen3_06b, dtype="float32", device="cuda", max_model_len=1024, max_num_seqs=16,
              num_kvcache_blocks=64, enforce_eager=enforce_eager, async_scheduling=async_scheduling)
    # lengths 49..64: the batch shrinks step by step, so graph buckets run with padding rows
    params = [SamplingParams(temperature=0, max_tokens=49 + i, ignore_eos=True) for i in range(len(prompts))]
    ours = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_transformers_greedy(qwen3_06b, prompts, ours)


def test_bf16_first_step_logits_close_to_transformers(qwen3_06b):
    """bf16 logits stay within 2% relative L2 error of transformers' float32 logits."""
    from nanoserve.runner.batch import SequenceWork

    prompts = random_prompts(8, 10000, 20, 300, seed=8)
    llm = LLM(qwen3_06b, dtype="bfloat16", device="cuda", max_model_len=1024, num_kvcache_blocks=64)
    runner = llm.engine.runner
    model = hf_model(qwen3_06b, torch.float32)
    for i, ids in enumerate(prompts):
        blocks = list(range(i * 2, i * 2 + 2))  # 2 blocks of 256 hold each prompt
        captured = {}
        original = runner.model.compute_logits
        runner.model.compute_logits = lambda h: captured.setdefault("logits", original(h))
        try:
            runner.run([SequenceWork(ids, len(ids), 0, len(ids), blocks, SamplingParams(temperature=0))])
        finally:
            runner.model.compute_logits = original
        with torch.no_grad():
            ref = model(torch.tensor([ids], device="cuda")).logits[0, -1].float()
        ours = captured["logits"][0].float()
        error = ((ours - ref).norm() / ref.norm()).item()
        assert error < 2e-2, f"prompt {i}: relative L2 error {error:.4f}"


def test_cpu_and_gpu_paths_agree_on_bundled_model():
    prompts = ["The function returns", "A list is", "In Python, a class", "import os\n", "Return the"]
    params = SamplingParams(temperature=0, max_tokens=32)
    cpu = LLM(device="cpu", dtype="float32").generate(prompts, params, use_tqdm=False)
    gpu = LLM(device="cuda", dtype="float32", num_kvcache_blocks=64).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in cpu] == [o.token_ids for o in gpu]


def test_float32_prompt_logprobs_match_transformers(qwen3_06b):
    """Prompt scoring on the GPU, in slices and across chunked prefill, against transformers."""
    prompts = random_prompts(3, 10000, 300, 700, seed=10)
    llm = LLM(qwen3_06b, dtype="float32", device="cuda", max_model_len=1024, num_kvcache_blocks=64,
              max_num_batched_tokens=512)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    model = hf_model(qwen3_06b, torch.float32)
    with torch.no_grad():
        for ids, out in zip(prompts, outputs):
            ref = model(torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1)
            entries = out.outputs[0].prompt_logprobs.entries()
            chosen = torch.tensor([entry[0] for entry in entries[1:]])
            expected = ref[:-1].gather(-1, torch.tensor(ids[1:], device="cuda")[:, None]).squeeze(-1).cpu()
            assert entries[0] is None and out.prompt_logprobs[0] is None
            assert torch.allclose(chosen, expected, atol=2e-3), (chosen - expected).abs().max()
            assert [t for t, _ in entries[1][1]] == ref[0].topk(3).indices.tolist()
