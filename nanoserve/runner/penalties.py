"""Presence, frequency and repetition penalties, logit bias and banned ids: the logit changes
that depend on a request's own tokens, applied in place before filtering and drawing.

The tokens of every penalized row go up in one flat copy and are counted by two scatters, so a
step pays the same few kernels for one penalized row or for 256. With pipelined scheduling the
last token of a decode row is still on the device (the previous launch's draw): it is counted
there, from that launch's sampled ids, so penalties never wait for the host to read it back.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from nanoserve.runner.batch import SequenceWork


def token_counts(rows: list[SequenceWork], vocab: int, device: torch.device,
                 prev_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: how often each id appears among its outputs so far ([rows, vocab] float32), and
    whether it appears anywhere in prompt or output ([rows, vocab] bool)."""
    # the tokens before the one being sampled; a placeholder (< 0) stands for a pending id
    known = [w.token_ids[:w.start + w.num_new] for w in rows]
    lengths = np.fromiter(map(len, known), dtype=np.int64, count=len(rows))
    prompt = np.fromiter((min(w.num_prompt_tokens, n) for w, n in zip(rows, lengths)), dtype=np.int64,
                         count=len(rows))
    ids = np.fromiter(itertools.chain.from_iterable(known), dtype=np.int64, count=int(lengths.sum()))
    row_of = np.repeat(np.arange(len(rows)), lengths)
    # position within its row, to tell prompt tokens from outputs
    position = np.arange(len(ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    real = ids >= 0
    is_output = real & (position >= np.repeat(prompt, lengths))
    counts = torch.zeros((len(rows), vocab), dtype=torch.float32, device=device)
    seen = torch.zeros((len(rows), vocab), dtype=torch.bool, device=device)

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    out_rows, out_ids = to_device(row_of[is_output]), to_device(ids[is_output])
    counts.index_put_((out_rows, out_ids), torch.ones(len(out_ids), device=device), accumulate=True)
    seen[to_device(row_of[real]), to_device(ids[real])] = True
    pending = [(r, w.prev_row) for r, w in enumerate(rows) if w.prev_row >= 0]
    if pending and prev_tokens is not None:
        # each such row's input token: an output the previous launch drew, not read back yet
        rows_t = to_device(np.array([r for r, _ in pending], dtype=np.int64))
        pending_ids = prev_tokens[to_device(np.array([p for _, p in pending], dtype=np.int64))]
        counts.index_put_((rows_t, pending_ids), torch.ones(len(pending), device=device), accumulate=True)
        seen[rows_t, pending_ids] = True
    return counts, seen


def apply_penalties(logits: torch.Tensor, rows: list[SequenceWork], prev_tokens: torch.Tensor | None = None) -> None:
    """Presence, frequency and repetition penalties, logit bias and banned ids, in place.

    `prev_tokens`: the previous launch's sampled ids, where rows with `prev_row` set find their
    pending input token."""
    device, vocab = logits.device, logits.shape[1]
    penalized = [i for i, w in enumerate(rows) if w.params.uses_penalties]
    if penalized:
        sub = logits[penalized]
        counts, seen = token_counts([rows[i] for i in penalized], vocab, device, prev_tokens)
        params = [rows[i].params for i in penalized]
        rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        # repetition penalty (prompt and output) divides positive logits and multiplies negative ones
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * counts.to(sub.dtype) - pres * (counts > 0).to(sub.dtype)
        logits[penalized] = sub
    for i, w in enumerate(rows):
        if w.params.logit_bias:
            # an id outside the vocabulary has no logit to move (clamping it would bias the last token)
            bias = {int(t): b for t, b in w.params.logit_bias.items() if 0 <= int(t) < vocab}
            ids = torch.tensor(list(bias), dtype=torch.int64, device=device)
            logits[i].index_add_(0, ids, torch.tensor(list(bias.values()), dtype=logits.dtype, device=device))
        if w.banned_token_ids:
            logits[i, list(w.banned_token_ids)] = float("-inf")
