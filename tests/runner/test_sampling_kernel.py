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
    # under the interpreter each row is a program run in Python: 300 rows, at a temperature whose
    # distribution (0.867 / 0.117 / 0.016) lies 10 standard errors (0.020 at 300 draws) from temperature
    # 1's (0.665 / 0.245 / 0.090) in its first token, 7 in its second and 10 in its third: a 4-error band
    # about each passes the one and fails the other. The seeds are fixed: a pass is the same every run
    n = 300
    logits = torch.tensor([[1.0, 0.0, -1.0, -30.0]]).repeat(n, 1)
    temperature = torch.full((n,), 0.5)
    tokens = gumbel_argmax(logits, temperature, torch.arange(n) * 7919 + 3)
    expected = torch.softmax(logits[0] / 0.5, dim=-1)
    observed = torch.bincount(tokens, minlength=4).float() / n
    # 4 standard errors of a binomial proportion at n draws
    assert torch.all((observed - expected).abs() <= 4 * (expected * (1 - expected) / n).sqrt() + 1e-3)
    assert observed[3] == 0


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


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """xgrammar's layout from a bool [rows, vocab]: bit j of int32 word i allows token 32 i + j."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, -(-vocab // 32) * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.view(rows, -1, 32) << torch.arange(32)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_a_grammar_mask_draws_what_the_masked_logits_draw_and_leaves_other_rows_alone():
    gen = torch.Generator().manual_seed(3)
    vocab = 5000 + 17  # a partial last word
    logits = torch.randn(6, vocab, generator=gen)
    allowed = torch.rand(3, vocab, generator=gen) < 0.05
    allowed[2] = False
    allowed[2, [4, vocab - 1]] = True  # a row allowed only two tokens, one in the last partial word
    mask_rows = torch.tensor([1, -1, 0, -1, 2, -1], dtype=torch.int32)
    masked = logits.clone()
    for row, m in enumerate(mask_rows.tolist()):
        if m >= 0:
            masked[row, ~allowed[m]] = float("-inf")
    temperature = torch.tensor([0.0, 0.0, 0.7, 1.0, 1.3, 0.0])
    seeds = torch.arange(6) * 31 + 5
    tokens = gumbel_argmax(logits, temperature, seeds, pack_bitmask(allowed), mask_rows)
    # the noise depends on (seed, column) alone, so masking in the kernel equals masking before it
    assert torch.equal(tokens, gumbel_argmax(masked, temperature, seeds))
    for row, m in enumerate(mask_rows.tolist()):
        if m >= 0:
            assert allowed[m, tokens[row]]
    assert tokens[4].item() in (4, vocab - 1)
    assert torch.equal(tokens[[1, 3, 5]], gumbel_argmax(logits, temperature, seeds)[[1, 3, 5]])
