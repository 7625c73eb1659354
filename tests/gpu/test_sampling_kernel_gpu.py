"""The chunked Gumbel-max kernel on the GPU, at the real vocabulary size (151,936, Qwen3's)."""

from __future__ import annotations

import pytest
import torch

from nanoserve.runner.sampling_kernel import gumbel_argmax

pytestmark = pytest.mark.gpu

VOCAB = 151936


def test_zero_temperature_equals_torch_argmax_on_bf16_logits():
    gen = torch.Generator(device="cuda").manual_seed(0)
    # bf16 has few distinct values near the top: ties are common, and the first index must win
    logits = torch.randn(256, VOCAB, generator=gen, device="cuda").to(torch.bfloat16)
    tokens = gumbel_argmax(logits, torch.zeros(256, device="cuda"), torch.arange(256, device="cuda"))
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_draws_follow_the_softmax_distribution():
    rows = 8192
    logits = torch.full((rows, VOCAB), -40.0, device="cuda")
    logits[:, :4] = torch.tensor([2.0, 1.0, 0.0, -1.0], device="cuda")
    logits[:, -1] = 1.5  # the last, partial chunk takes part too
    temperature = torch.full((rows,), 0.7, device="cuda")
    tokens = gumbel_argmax(logits.bfloat16(), temperature, torch.randint(0, 2**31 - 1, (rows,), device="cuda"))
    expected = torch.softmax(logits[0].bfloat16().float() / 0.7, dim=-1)
    observed = torch.bincount(tokens, minlength=VOCAB).float() / rows
    picked = [0, 1, 2, 3, VOCAB - 1]
    bound = 4 * (expected[picked] * (1 - expected[picked]) / rows).sqrt() + 1e-3
    assert torch.all((observed[picked] - expected[picked]).abs() <= bound)
    assert observed[picked].sum() > 0.999


def test_same_seed_same_token_whatever_the_batch():
    gen = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(64, VOCAB, generator=gen, device="cuda").to(torch.bfloat16)
    temperature = torch.ones(64, device="cuda")
    seeds = torch.arange(500, 564, device="cuda")
    batch = gumbel_argmax(logits, temperature, seeds)
    for row in (0, 17, 63):
        alone = gumbel_argmax(logits[row:row + 1], temperature[:1], seeds[row:row + 1])
        assert alone.item() == batch[row].item()
    assert not torch.equal(gumbel_argmax(logits, temperature, seeds + 1), batch)


@pytest.mark.parametrize("seed", [42, 7, 1234])
def test_a_seeded_row_draws_the_same_token_on_every_sampling_path(seed):
    """Its batch-mates decide the path (the fused kernel, top-k candidates, the full sort); a
    seeded row draws the same token on each."""
    from nanoserve.runner.batch import SequenceWork
    from nanoserve.runner.sampler import sample
    from nanoserve.sampling_params import SamplingParams

    def row(params: SamplingParams) -> SequenceWork:
        return SequenceWork([1, 2, 3], 3, 2, 1, [0], params)

    vocab = 151936
    gen = torch.Generator(device="cuda").manual_seed(seed)
    target = torch.randn(1, vocab, device="cuda", generator=gen) * 2
    seeded = SamplingParams(temperature=1.0, seed=seed)
    picks = {}
    for path, mate in {"alone": None, "fused": SamplingParams(temperature=0.8),
                       "top-k": SamplingParams(top_k=20, top_p=0.95), "full": SamplingParams(top_p=0.9)}.items():
        mates = [] if mate is None else [mate] * 3
        logits = torch.cat([target, torch.randn(len(mates), vocab, device="cuda", generator=gen)]).bfloat16()
        picks[path] = sample(logits, [row(seeded)] + [row(m) for m in mates]).token_ids[0]
    assert len(set(picks.values())) == 1, picks


def test_rows_with_a_small_top_k_draw_inside_their_allowed_sets_at_the_real_vocabulary():
    """The top-k candidate path on the GPU, bf16 logits of Qwen3's vocabulary, its generation
    config's settings (top_k 20, top_p 0.95, temperature 0.6) beside greedy and min-p rows."""
    from nanoserve.runner.batch import SequenceWork
    from nanoserve.runner.sampler import sample
    from nanoserve.sampling_params import SamplingParams
    from tests.runner.test_sampler import allowed_tokens

    gen = torch.Generator(device="cuda").manual_seed(11)
    logits = (torch.randn(32, VOCAB, device="cuda", generator=gen)
              * torch.linspace(0.5, 6.0, 32, device="cuda")[:, None]).bfloat16()
    params = [SamplingParams(top_k=20, top_p=0.95, temperature=0.6), SamplingParams(temperature=0.0),
              SamplingParams(top_k=64, min_p=0.1, temperature=1.2)]
    rows = [SequenceWork([1, 2, 3], 3, 2, 1, [0], params[i % 3]) for i in range(32)]
    seen = [set() for _ in range(32)]
    for _ in range(30):
        for i, t in enumerate(sample(logits, rows).token_ids):
            seen[i].add(t)
    host = logits.float().cpu().numpy()
    for i in range(32):
        p = params[i % 3]
        if p.temperature == 0.0:
            assert seen[i] == {int(logits[i].float().argmax())}
        else:
            assert seen[i] <= allowed_tokens(host[i], p, slack=1e-2), f"row {i}"
    assert any(len(seen[i]) > 1 for i in range(32) if i % 3 != 1)


def test_a_grammar_mask_in_the_kernel_draws_what_the_masked_logits_draw():
    """Fresh bf16 logits of Qwen3's vocabulary, half the rows under a random bitmask (some allowing
    a handful of tokens), greedy and sampled: the same ids as masking the logits with -inf first."""
    from tests.runner.test_sampling_kernel import pack_bitmask

    gen = torch.Generator(device="cuda").manual_seed(5)
    logits = torch.randn(256, VOCAB, device="cuda", generator=gen).bfloat16()
    allowed = torch.rand(128, VOCAB, device="cuda", generator=gen) < torch.logspace(-4.5, -0.5, 128, device="cuda")[:, None]
    allowed[:, VOCAB - 1] = True  # the last, partial chunk
    mask_rows = torch.full((256,), -1, dtype=torch.int32, device="cuda")
    constrained = torch.randperm(256, device="cuda", generator=gen)[:128]
    mask_rows[constrained] = torch.arange(128, dtype=torch.int32, device="cuda")
    masked = logits.clone()
    masked[constrained] = logits[constrained].masked_fill(~allowed, float("-inf"))
    temperature = torch.rand(256, device="cuda", generator=gen) + 0.2
    temperature[::4] = 0.0
    seeds = torch.randint(0, 2**31 - 1, (256,), device="cuda", generator=gen)
    tokens = gumbel_argmax(logits, temperature, seeds, pack_bitmask(allowed.cpu()).cuda(), mask_rows)
    assert torch.equal(tokens, gumbel_argmax(masked, temperature, seeds))
    assert allowed[mask_rows[constrained].long(), tokens[constrained]].all()


def test_draw_applies_a_token_mask_in_the_fused_kernel_as_xgrammar_applies_it():
    """The sampler's fused path with a TokenMask (pinned, compact rows) against xgrammar's own
    kernel on the logits and the same path without a mask, same per-step seeds."""
    from nanoserve.runner.batch import SequenceWork, TokenMask
    from nanoserve.runner.sampler import apply_token_mask, draw
    from nanoserve.sampling_params import SamplingParams
    from tests.runner.test_sampling_kernel import pack_bitmask

    gen = torch.Generator(device="cuda").manual_seed(6)
    logits = torch.randn(64, VOCAB, device="cuda", generator=gen).bfloat16()
    rows = [SequenceWork([1, 2, 3], 3, 2, 1, [0], SamplingParams(temperature=0.0 if i % 3 == 0 else 0.9))
            for i in range(64)]
    allowed = torch.rand(20, VOCAB, generator=torch.Generator().manual_seed(6)) < 0.01
    mask = TokenMask(pack_bitmask(allowed).pin_memory(), list(range(3, 63, 3)))
    torch.manual_seed(0)
    fused, _ = draw(logits.clone(), rows, mask)
    reference = logits.clone()
    apply_token_mask(reference, mask)
    torch.manual_seed(0)
    plain, _ = draw(reference, rows, None)
    assert torch.equal(fused, plain)
    assert all(allowed[i, fused[r]] for i, r in enumerate(mask.rows))
