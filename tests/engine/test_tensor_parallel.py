"""Tensor parallelism on the CPU (gloo, one worker process per extra rank): the same greedy tokens
as transformers, with heads, MLP columns and vocabulary split, and KV heads copied when there are
fewer of them than ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nanoserve import LLM, EngineConfig, SamplingParams
from tests.conftest import greedy, hf_greedy, random_prompts

# a rank that dies leaves the others waiting in a collective: fail the test instead of stalling CI
pytestmark = pytest.mark.timeout(300)


# each case starts a worker process (seconds). Mistral splits as llama3 does (the same decoder, one
# KV head copied to both ranks; only the rope frequencies differ), and pipelining is the engine's,
# the same for every model: it runs over split (qwen3) and copied (llama3) KV heads
@pytest.mark.parametrize("random_model, async_scheduling", [
    ("qwen3-gqa-tied", False), ("llama3-rope-scaling", False), ("qwen2-bias", False),
    ("qwen3-gqa-tied", True), ("llama3-rope-scaling", True),
], ids=lambda v: {False: "sync", True: "pipelined"}.get(v, v), indirect=["random_model"])
def test_two_ranks_match_hf_through_chunks_and_preemption(random_model, async_scheduling):
    prompts = random_prompts(8, 384, 10, 70, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with LLM(random_model, dtype="float32", device="cpu", tensor_parallel_size=2, block_size=8,
             num_kvcache_blocks=32, max_model_len=128, max_num_batched_tokens=40, max_num_seqs=8,
             async_scheduling=async_scheduling) as llm:
        runner, hf = llm.engine.runner, llm.engine.config.hf_config
        assert runner.kv_cache.tensor.shape[4] == max(1, hf.num_key_value_heads // 2)
        assert runner.model.model.embed_tokens.weight.shape[0] == hf.vocab_size // 2  # vocabulary split too
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.block_manager.num_free_blocks == 32
        workers = llm.engine.runner.workers
    assert got == hf_greedy(random_model, prompts, params.max_tokens)
    assert len(workers) == 1 and not workers[0].is_alive()  # close() ended the worker


def test_two_ranks_run_sequences_longer_than_the_cache_through_a_sliding_window(tmp_path):
    # rank 0's block manager gives back the blocks behind the window: the worker reads the same tables,
    # stand-ins included. 8 blocks (128 keys) for three sequences of 100-130 tokens
    from tests.conftest import _random_model
    folder = _random_model(tmp_path / "model", "mistral", sliding_window=16)
    prompts = random_prompts(3, 384, 40, 70, seed=24)
    with LLM(folder, dtype="float32", device="cpu", tensor_parallel_size=2, block_size=16, num_kvcache_blocks=8,
             max_num_batched_tokens=32, max_num_seqs=3, max_model_len=256) as llm:
        got = greedy(llm, prompts, 60)
        assert llm.engine.block_manager.num_free_blocks == 8
    assert got == hf_greedy(folder, prompts, 60)


def test_two_ranks_add_the_o_and_down_biases_once(tmp_path):
    # o_proj and down_proj sum the ranks' partial products: their bias, whole on each rank, goes in after the sum
    from tests.conftest import _random_model
    folder = _random_model(tmp_path / "model", "llama", attention_bias=True, mlp_bias=True)
    prompts = random_prompts(3, 384, 10, 40, seed=23)
    with LLM(folder, dtype="float32", device="cpu", tensor_parallel_size=2, max_model_len=128) as llm:
        got = greedy(llm, prompts, 12)
    assert got == hf_greedy(folder, prompts, 12)


def test_prompt_logprobs_with_two_ranks_equal_one_rank(qwen3_model):
    prompts = random_prompts(3, 384, 20, 50, seed=22)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    one = LLM(qwen3_model, dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False)
    with LLM(qwen3_model, dtype="float32", device="cpu", tensor_parallel_size=2) as llm:
        two = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(one, two):
        assert a.token_ids == b.token_ids
        assert [e[0] for e in b.outputs[0].prompt_logprobs.entries()[1:]] == pytest.approx(
            [e[0] for e in a.outputs[0].prompt_logprobs.entries()[1:]], abs=1e-4)


@pytest.mark.parametrize("size, extra, message", [
    (3, {}, "must divide"),
    (0, {}, "at least 1"),
])
def test_unsupported_splits_are_refused_at_start(qwen3_model, size, extra, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=qwen3_model, device="cpu", tensor_parallel_size=size, **extra)


def test_a_process_that_never_closes_its_engine_still_exits(qwen3_model):
    # multiprocessing's exit hook SIGTERMs daemon children and waits for them; the workers ignore SIGTERM
    script = (f"from nanoserve import LLM; llm = LLM({str(qwen3_model)!r}, device='cpu', tensor_parallel_size=2); "
              "print(len(llm.generate('hi', use_tqdm=False)[0].token_ids) > 0)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]


def test_a_worker_that_dies_before_it_starts_is_an_error_not_a_silent_wait(qwen3_model, tmp_path):
    # spawn re-imports the main script in the worker: one that builds LLM(...) at its top level, with
    # no __main__ guard, killed the worker at once, and rank 0 waited for it in the rendezvous
    script = tmp_path / "unguarded.py"
    script.write_text(f"from nanoserve import LLM\nllm = LLM({str(qwen3_model)!r}, device='cpu', "
                      "tensor_parallel_size=2)\nprint('served')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0 and "served" not in done.stdout
    assert "exited (code 1) before it started" in done.stderr and '__name__ == "__main__"' in done.stderr, \
        done.stderr[-2000:]
