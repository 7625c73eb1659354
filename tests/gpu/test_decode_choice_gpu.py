"""The startup choice of the decode attention's variant on the GPU: real timings over a real
cache, bf16 and fp8; whatever it picks agrees with the dot on fresh inputs."""

from __future__ import annotations

import pytest
import torch

from nanoserve.runner.attention.decode_choice import CANDIDATES, choose_decode_config
from nanoserve.runner.attention.fp8 import FP8_DTYPE
from nanoserve.runner.attention.triton_decode import paged_decode

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
@pytest.mark.parametrize("q_heads", [16, 32])
def test_the_choice_is_the_dot_or_a_candidate_that_agrees_with_it(cache_dtype, q_heads):
    k = torch.empty(600, 256, 8, 128, dtype=cache_dtype, device="cuda")
    v = torch.empty_like(k)
    config = choose_decode_config(k, v, q_heads, batch=64, context=2048, dtype=torch.bfloat16)
    assert config is None or config in CANDIDATES
    if config is not None:
        q = torch.randn(9, q_heads, 128, device="cuda").bfloat16()
        tables = torch.randperm(64, device="cuda")[:9 * 7].view(9, 7).int()
        seq_lens = torch.randint(1, 7 * 256, (9,), dtype=torch.int32, device="cuda")
        want = paged_decode(q, k, v, seq_lens, tables, 128 ** -0.5, 7 * 256).float()
        got = paged_decode(q, k, v, seq_lens, tables, 128 ** -0.5, 7 * 256, config=config).float()
        assert (got - want).norm() <= 1e-2 * want.norm()
