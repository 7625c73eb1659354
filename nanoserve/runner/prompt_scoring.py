"""Prompt logprobs: how likely the model found each prompt token, read off the rows that predict it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from nanoserve.runner.batch import PromptScores
from nanoserve.runner.inputs import PromptLogprobRows
from nanoserve.runner.sampler import MIN_LOGPROB

# rows of float32 logits scored at once: a long prompt is scored in slices no larger than the
# sampling step of the default max_num_seqs (256), not in one [prompt, vocab] tensor
PROMPT_SCORING_ROWS = 256


def score_prompt(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                 asks: PromptLogprobRows) -> list[PromptScores]:
    """For each asking sequence, in work order, the scores of the prompt tokens its rows predict:
    each token's logprob and rank, and the sequence's top_n alternatives. Reads them back to the host
    as a few arrays for the whole step: a Python object per token and alternative (millions for a
    batch of long prompts) kept both processes' garbage collectors busy for as long as a request lived."""
    width = max(max(asks.top_n), 1)  # top-0 still takes one: a zero-width top-k is not asked of every device
    chosen, ranks, top_values, top_ids = [], [], [], []
    for s in range(0, len(asks.rows), PROMPT_SCORING_ROWS):
        logprobs = compute_logits(hidden[asks.rows[s:s + PROMPT_SCORING_ROWS]]).float().log_softmax(dim=-1)
        target = logprobs.gather(-1, asks.targets[s:s + PROMPT_SCORING_ROWS, None])
        chosen.append(target.squeeze(-1).clamp(min=MIN_LOGPROB))
        ranks.append((logprobs > target).sum(-1).to(torch.int32) + 1)
        values, ids = logprobs.topk(width, dim=-1)
        top_values.append(values.clamp(min=MIN_LOGPROB))
        top_ids.append(ids.to(torch.int32))
    if not chosen:
        return [PromptScores(np.empty(0, np.float32), np.empty(0, np.int32), np.empty((0, n), np.int32),
                             np.empty((0, n), np.float32)) for n in asks.top_n]
    # every slice is queued before the first read back
    chosen_np, ranks_np, values_np, ids_np = (torch.cat(parts).cpu().numpy()
                                              for parts in (chosen, ranks, top_values, top_ids))
    bounds = np.cumsum([0, *asks.counts])
    return [PromptScores(chosen_np[a:b], ranks_np[a:b], ids_np[a:b, :n], values_np[a:b, :n])
            for a, b, n in zip(bounds[:-1], bounds[1:], asks.top_n)]
