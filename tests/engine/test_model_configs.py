"""Configs that load must answer as transformers does; those that cannot are refused by what they ask."""

from __future__ import annotations

import json
import os

import pytest

from nanoserve import LLM, SamplingParams
from tests.conftest import _random_model, greedy, hf_greedy, random_prompts


@pytest.mark.parametrize("arch, overrides, refusal", [
    ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("qwen3", dict(hidden_act="relu"), "hidden_act 'relu'"),
    ("llama", dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                 "original_max_position_embeddings": 32}), "longrope"),
], ids=["llama-gelu", "qwen3-relu", "llama-longrope"])
def test_what_would_answer_wrongly_is_refused_by_name(tmp_path, arch, overrides, refusal):
    # each loaded and answered with SiLU, the short rope factors or full attention: not what it is
    folder = _random_model(tmp_path / "model", arch, **overrides)
    with pytest.raises(ValueError, match=refusal):
        LLM(folder, device="cpu", max_model_len=64)


# the flags as each family's transformers modeling reads them: Llama's attention_bias puts a bias on q, k, v
# and o, its mlp_bias on gate, up and down; Qwen3 reads attention_bias; Mistral reads neither
@pytest.mark.parametrize("arch, overrides", [
    ("llama", dict(attention_bias=True, mlp_bias=True)),
    ("llama", dict(mlp_bias=True)),
    ("qwen3", dict(attention_bias=True)),
    ("mistral", dict(attention_bias=True, mlp_bias=True)),
], ids=["llama-both", "llama-mlp", "qwen3-attention", "mistral-ignores-both"])
@pytest.mark.parametrize("backend", ["torch", "triton"])   # triton: the kernels under the interpreter
def test_biases_answer_as_transformers(tmp_path, arch, overrides, backend):
    folder = _random_model(tmp_path / "model", arch, **overrides)
    # two prompts (a decode step of two rows) and 8 tokens: each bias moves the first token's logits
    # already, and under the interpreter every decode row and prompt token is a program run in Python
    prompts = random_prompts(2, 384, 10, 30, seed=3)
    with LLM(folder, device="cpu", attention_backend=backend, max_model_len=128) as llm:
        layer = llm.engine.runner.model.model.layers[0]
        want = dict(overrides) if arch != "mistral" else {}
        assert (layer.self_attn.o_proj.bias is not None) == want.get("attention_bias", False)
        assert (layer.mlp.down_proj.bias is not None) == want.get("mlp_bias", False)
        ours = greedy(llm, prompts, 8)
    assert ours == hf_greedy(folder, prompts, 8)


def test_a_sliding_window_no_layer_uses_is_no_refusal(tmp_path):
    # Qwen2 keeps full attention below max_window_layers: here that is every layer
    folder = _random_model(tmp_path / "model", "qwen2", use_sliding_window=True, sliding_window=16,
                           max_window_layers=2)
    prompts = random_prompts(2, 384, 40, 60)
    with LLM(folder, device="cpu", max_model_len=128) as llm:
        ours = greedy(llm, prompts, 8)
    assert ours == hf_greedy(folder, prompts, 8)


@pytest.mark.parametrize("backend", ["torch", "triton"])   # triton: the kernels under the interpreter
def test_a_sliding_window_answers_as_transformers_past_the_window(tmp_path, backend):
    # Mistral 7B v0.1 attends over 4,096 tokens of its 32,768 positions: the context was capped at the
    # window; now it is the model's, and past the window each query attends its last 32 keys only.
    # Prompts of 45-65 tokens in chunks of 24 (a third chunk's history is past the window), then decode
    # up to ~75. A window of two 16-key tiles still has the prefill kernel skip the tiles before it and
    # take each of its three loops (masked by the window, unmasked, along the diagonal)
    folder = _random_model(tmp_path / "model", "mistral", num_key_value_heads=1, sliding_window=32)
    prompts = random_prompts(3, 384, 45, 65, seed=1)
    with LLM(folder, device="cpu", attention_backend=backend, max_num_batched_tokens=24, max_num_seqs=4) as llm:
        assert llm.engine.config.max_model_len == 512
        ours = greedy(llm, prompts, 10)
    assert ours == hf_greedy(folder, prompts, 10)


# the torch backend: what is tested is the block manager's; the kernels' windows are tested past the
# window above and in tests/runner/test_sliding_window.py (17 s more under the interpreter)
@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_a_sliding_window_model_runs_sequences_longer_than_its_kv_cache(tmp_path, pipelined):
    # every layer slides over 16 keys: a sequence holds its window and the step's chunk, the blocks
    # behind them go back to the pool and their table entries name a stand-in. 6 blocks of 16 tokens
    # (96 keys) serve two sequences of 120-140 at once, and they answer as transformers does
    folder = _random_model(tmp_path / "model", "mistral", num_key_value_heads=1, sliding_window=16)
    prompts = random_prompts(2, 384, 40, 60, seed=4)
    # pipelined: each step is placed before the last one's tokens are read back and its blocks committed
    with LLM(folder, device="cpu", max_num_batched_tokens=32, max_num_seqs=2, num_kvcache_blocks=6,
             max_model_len=256, async_scheduling=pipelined) as llm:
        assert llm.engine.config.blocks_per_sequence() == 4   # (15 + 32) keys over 3 blocks, and one more
        ours = greedy(llm, prompts, 80)
        assert llm.engine.block_manager.num_free_blocks == 6
    assert ours == hf_greedy(folder, prompts, 80)


def test_a_sliding_window_conversation_reuses_its_window_after_its_start_is_evicted(tmp_path):
    # a second turn repeats the first's 100 tokens; a request between took the first blocks given back.
    # Under a 16-key window the next query needs only the last blocks: they are reused, as transformers
    # answers (a prefix hit that needs every block from the first would find none)
    folder = _random_model(tmp_path / "model", "mistral", num_key_value_heads=1, sliding_window=16)
    first, other, extra = random_prompts(3, 384, 20, 70, seed=5)
    with LLM(folder, device="cpu", max_num_batched_tokens=32, max_num_seqs=1, num_kvcache_blocks=8,
             max_model_len=256) as llm:
        turn = first + greedy(llm, [first], 40)[0]
        greedy(llm, [other], 30)
        second = turn + extra
        out = llm.generate([second], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert out.num_cached_tokens >= 16 * (len(turn) // 16) - 16
    assert out.outputs[0].token_ids == hf_greedy(folder, [second], 10)[0]


def test_qwen2s_sliding_layers_answer_as_transformers_past_the_window(tmp_path):
    # max_window_layers 1: layer 0 attends in full, layer 1 over its last 16 keys (transformers' layer_types)
    folder = _random_model(tmp_path / "model", "qwen2", use_sliding_window=True, sliding_window=16,
                           max_window_layers=1)
    prompts = random_prompts(2, 384, 30, 50, seed=2)
    with LLM(folder, device="cpu", max_model_len=128) as llm:
        assert [layer.self_attn.window for layer in llm.engine.runner.model.model.layers] == [None, 16]
        ours = greedy(llm, prompts, 12)
    assert ours == hf_greedy(folder, prompts, 12)


def test_disable_sliding_window_caps_the_context_at_the_window_as_vllm_does(tmp_path):
    from nanoserve.cli import build_parser
    from nanoserve.engine_flags import engine_kwargs
    folder = _random_model(tmp_path / "model", "mistral", num_key_value_heads=1, sliding_window=64)
    args = build_parser().parse_args(["serve", folder, "--device", "cpu", "--disable-sliding-window"])
    assert engine_kwargs(args, folder)["disable_sliding_window"] is True   # vLLM's flag reaches the config
    with pytest.raises(ValueError, match=r"max_model_len \(65\) is past the model's sliding-window attention span "
                                         r"\(64 tokens\).*max_model_len <= 64"):
        LLM(folder, device="cpu", max_model_len=65, disable_sliding_window=True)
    prompts = random_prompts(3, 384, 40, 56)
    with LLM(folder, device="cpu", disable_sliding_window=True) as llm:
        assert llm.engine.config.max_model_len == 64
        # within the window, full attention is the window's: the layers compute no window
        assert all(layer.self_attn.window is None for layer in llm.engine.runner.model.model.layers)
        ours = greedy(llm, prompts, 8)
        with pytest.raises(ValueError, match="64"):   # a prompt as long as the window leaves no room
            llm.generate([random_prompts(1, 384, 64, 65)[0]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert ours == hf_greedy(folder, prompts, 8)


def test_without_generation_config_the_models_config_names_its_end_token(tmp_path):
    folder = _random_model(tmp_path / "model", "llama")
    os.remove(os.path.join(folder, "generation_config.json"))
    prompt = random_prompts(1, 384, 8, 9)[0]
    with LLM(folder, device="cpu") as llm:
        free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                                        ignore_eos=True), use_tqdm=False)
    end = free[0].outputs[0].token_ids[3]   # a token the model writes: config.json names it its end
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["eos_token_id"] = end
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with LLM(folder, device="cpu") as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12),
                           use_tqdm=False)[0].outputs[0]
    first = free[0].outputs[0].token_ids.index(end)
    assert out.finish_reason == "stop" and out.token_ids == free[0].outputs[0].token_ids[:first + 1]


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                                     {"rope_type": "linear", "factor": 2.0}], ids=["yarn", "linear"])
def test_a_static_rope_scaling_stretches_the_context_as_vllm_derives_it(tmp_path, scaling):
    # Qwen3's documented long context: yarn x4 over its original length, past max_position_embeddings
    # (40,960 there), was refused; positions past it must still answer as transformers does
    folder = _random_model(tmp_path / "model", "qwen3", max_position_embeddings=128, rope_scaling=scaling)
    prompts = random_prompts(2, 384, 150, 200)
    with LLM(folder, device="cpu", num_kvcache_blocks=64, block_size=16) as llm:
        assert llm.engine.config.max_model_len == 256
        ours = greedy(llm, prompts, 8)
    assert ours == hf_greedy(folder, prompts, 8)
    with pytest.raises(ValueError, match="larger than the model's context"):
        LLM(folder, device="cpu", max_model_len=257)
