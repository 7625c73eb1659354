"""Shared fixtures: the bundled model and small random-weight models, built once per session."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run under the interpreter when there is no GPU; it must be on before import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # parallel test workers (pytest -n) share the cores: torch's pool per worker would oversubscribe them,
    # and OpenMP's waiting threads spin on the cores the other worker needs. The processes a test starts
    # (engine cores, tensor-parallel ranks, servers) inherit the variable
    if os.environ.get("PYTEST_XDIST_WORKER"):
        share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)))
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY_TEXT = ("The quick brown fox jumps over the lazy dog. A list holds items in order; a dict maps keys "
             "to values. Functions return values, and classes define objects with methods. " * 20)


def _save_tokenizer(folder: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TINY_TEXT], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)


def _random_model(folder, arch: str, **overrides) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    config_cls = {"qwen3": Qwen3Config, "llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    base = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0, bos_token_id=0)
    base.update(overrides)
    config = config_cls(**base)
    torch.manual_seed(len(str(folder)))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # the default init makes near-uniform logits; widen them for clear argmaxes
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    _save_tokenizer(str(folder))
    return str(folder)


RANDOM_MODELS = {
    "qwen3-gqa-tied": ("qwen3", dict(tie_word_embeddings=True, head_dim=32)),
    "llama3-rope-scaling": ("llama", dict(num_key_value_heads=1, rope_theta=500000.0,
                                          rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 128})),
    "qwen2-bias": ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral": ("mistral", dict(num_key_value_heads=1, sliding_window=None, rope_theta=1000000.0)),
}


@pytest.fixture(scope="session", params=sorted(RANDOM_MODELS))
def random_model(request, tmp_path_factory) -> str:
    arch, overrides = RANDOM_MODELS[request.param]
    return _random_model(tmp_path_factory.mktemp(request.param), arch, **overrides)


@pytest.fixture(scope="session")
def qwen3_model(tmp_path_factory) -> str:
    arch, overrides = RANDOM_MODELS["qwen3-gqa-tied"]
    return _random_model(tmp_path_factory.mktemp("qwen3"), arch, **overrides)


def greedy(llm, prompts: list, max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens from an LLM, as hf_greedy gives transformers' (eos ignored)."""
    from nanoserve import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def hf_greedy(model_path: str, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = False
              ) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time (no padding to disturb the numbers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    if not stop_at_eos:
        model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(out[0, len(ids):].tolist())
    return outs


def hf_logprobs(model_path: str, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax at each position of `tokens` (row p scores the token at p + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].log_softmax(dim=-1)


def assert_rank(row: torch.Tensor, value: float, rank: int) -> None:
    """`rank` is 1 + how many of `row` beat `value` (ties within float noise may count either way)."""
    assert int((row > value + 1e-4).sum()) + 1 <= rank <= int((row > value - 1e-4).sum()) + 1


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, vocab, (shared_prefix,), generator=gen).tolist()
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [prefix + torch.randint(1, vocab, (length,), generator=gen).tolist() for length in lengths]
