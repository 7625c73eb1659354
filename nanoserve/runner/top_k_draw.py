"""Sampling when every sampled row has a small top-k (Qwen3's generation config asks for 20):
the filters and the draw work on each row's k best logits, not on the whole vocabulary.

One top-k over [rows, vocab] replaces a full sort of it, a scatter back and two softmaxes over
the vocabulary. The result is the same distribution as the full path's (sampler.filter_logits):
temperature, top-k, top-p over what top-k left (renormalized), min-p relative to the most likely
token, then an exponential race among the survivors.
"""

from __future__ import annotations

import torch

# past this many candidates a row is cheaper to filter over the whole vocabulary
MAX_CANDIDATES = 1024


def seeded_noise(seed: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise for each token id of a seeded row, from the row's own generator.

    Every sampling path draws a seeded row with this noise (an exponential race over token ids).
    Which path a step takes depends on the rest of the batch, and a seeded row must not notice."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.empty(vocab_size, dtype=torch.float32, device=device).exponential_(generator=gen)


def draw_from_top_k(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor | None, min_p: torch.Tensor | None, k: int,
                    seeded: dict[int, int]) -> torch.Tensor:
    """One token per row of logits [rows, vocab], drawn among its top_k[row] <= k best.

    `seeded` maps a row to its seed: that row's noise comes from its own generator, so the batch
    around it cannot change its draw."""
    values, ids = logits.topk(k, dim=-1)   # sorted, best first
    x = values.float() / temperature[:, None]
    drop = torch.arange(k, device=logits.device)[None, :] >= top_k[:, None]
    if top_p is not None:
        probs = x.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # drop a token once the mass before it already reaches top_p; the first always stays
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        drop[:, 0] = False
    if min_p is not None:
        drop |= (x - x[:, :1]).exp() < min_p[:, None]   # x[:, 0] is the most likely token
    probs = x.masked_fill(drop, float("-inf")).softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, seed in seeded.items():
        noise[row] = seeded_noise(seed, logits.shape[1], probs.device)[ids[row]]
    choice = (probs / noise).argmax(dim=-1, keepdim=True)   # the exponential race: a draw from probs
    return ids.gather(1, choice).squeeze(1)
