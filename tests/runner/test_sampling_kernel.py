"""The fused Gumbel-max kernel draws from softmax(logits / T), is argmax at T = 0, and is seeded per row.

On the CPU it runs under the Triton interpreter (tests/conftest.py turns it on)."""

from __future__ import annotations

import torch

from nanoserve.runner.sampling_kernel import gumbel_argmax


def test_zero_temperature_is_argmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 5000, generator=gen)
    tokens = gumbel_argmax(logits, torch.zeros(6), torch.arange(6))
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_ties_across_chunks_take_the_first_index():
    from nanoserve.runner.sampling_kernel import CHUNK

    logits = torch.zeros(3, 3 * CHUNK + 5)
    logits[0, [CHUNK + 7, 2 * CHUNK + 1]] = 4.0   # equal maxima in two later chunks
    logits[1, [3, 3 * CHUNK + 2]] = 4.0            # the first and the last, partial chunk
    logits[2, -1] = 4.0
    tokens = gumbel_argmax(logits, torch.zeros(3), torch.arange(3))
    assert tokens.tolist() == [CHUNK + 7, 3, 3 * CHUNK + 4]


def test_draws_follow_the_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).repeat(1500, 1)
    temperature = torch.full((1500,), 0.8)
    tokens = gumbel_argmax(logits, temperature, torch.arange(1500) * 7919 + 3)
    expected = torch.softmax(logits[0] / 0.8, dim=-1)
    observed = torch.bincount(tokens, minlength=5).float() / 1500
    # 4 standard errors of a binomial proportion at n = 1500
    assert torch.all((observed - expected).abs() <= 4 * (expected * (1 - expected) / 1500).sqrt() + 1e-3)
    assert observed[4] == 0


def test_same_seed_same_token_whatever_the_batch():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 3000, generator=gen)
    temperature = torch.ones(8)
    seeds = torch.arange(100, 108)
    batch = gumbel_argmax(logits, temperature, seeds)
    for row in (0, 5):
        alone = gumbel_argmax(logits[row:row + 1], temperature[:1], seeds[row:row + 1])
        assert alone.item() == batch[row].item()
    other = gumbel_argmax(logits, temperature, seeds + 1000)
    assert not torch.equal(other, batch)  # 8 draws over 3000 tokens: equal only if seeds were ignored
