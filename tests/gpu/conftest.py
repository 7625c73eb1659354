"""Shared by the GPU tests: a random-weight Qwen3-0.6B saved as a Hugging Face folder, and its
transformers reference on the GPU."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import _save_tokenizer

CONFIG_06B = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "configs", "qwen3-0.6b.json")


@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory) -> str:
    """Random weights in the Qwen3-0.6B architecture, saved as a Hugging Face folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(CONFIG_06B) as f:
        values = json.load(f)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("qwen3-0.6b")
    model.save_pretrained(folder)
    _save_tokenizer(str(folder))
    return str(folder)


def hf_model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None
    return model


def assert_transformers_greedy(path: str, prompts: list[list[int]], ours: list[list[int]]) -> None:
    """Each of our greedy continuations equals transformers' float32 greedy continuation of its prompt."""
    model = hf_model(path, torch.float32)
    with torch.no_grad():
        for ids, got in zip(prompts, ours):
            out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=len(got), do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                                 pad_token_id=0)
            assert got == out[0, len(ids):].tolist()
