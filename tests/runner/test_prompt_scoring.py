"""Prompt scoring: each asking sequence's packed arrays hold, row by row, the log-softmax of its rows'
logits at the prompt's next token, that token's rank, and its own number of top alternatives."""

from __future__ import annotations

import numpy as np
import torch

from nanoserve.runner.inputs import PromptLogprobRows
from nanoserve.runner.prompt_scoring import PROMPT_SCORING_ROWS, score_prompt
from nanoserve.runner.sampler import MIN_LOGPROB

VOCAB = 64


def test_each_sequence_gets_its_rows_ranks_and_top_n_across_scoring_slices():
    gen = torch.Generator().manual_seed(0)
    counts, top_n = [PROMPT_SCORING_ROWS + 37, 5, 120], [3, 0, 7]   # the first spans two slices
    hidden = torch.randn(sum(counts) + 10, VOCAB, generator=gen) * 4
    hidden[3, 9] = -1e5   # a token far below MIN_LOGPROB, made the target of row 3
    rows = torch.randperm(len(hidden), generator=gen)[:sum(counts)]
    rows[3] = 3
    targets = torch.randint(VOCAB, (sum(counts),), generator=gen)
    targets[3] = 9
    scores = score_prompt(lambda h: h, hidden, PromptLogprobRows(rows, targets, counts, top_n))

    expected = hidden[rows].log_softmax(dim=-1)
    assert [len(s) for s in scores] == counts
    start = 0
    for s, n, count in zip(scores, top_n, counts):
        want = expected[start:start + count]
        target = targets[start:start + count]
        chosen = want.gather(1, target[:, None]).squeeze(1)
        assert s.logprobs.dtype == np.float32 and s.ranks.dtype == np.int32 and s.top_ids.dtype == np.int32
        assert s.top_ids.shape == s.top_logprobs.shape == (count, n)
        np.testing.assert_array_equal(s.logprobs, chosen.clamp(min=MIN_LOGPROB).numpy())
        np.testing.assert_array_equal(s.ranks, ((want > chosen[:, None]).sum(1) + 1).numpy())
        values, ids = want.topk(max(n, 1), dim=-1)
        np.testing.assert_array_equal(s.top_ids, ids[:, :n].numpy())
        np.testing.assert_array_equal(s.top_logprobs, values[:, :n].numpy())
        start += count
    assert scores[0].logprobs[3] == MIN_LOGPROB and scores[0].ranks[3] == VOCAB
