"""Presence, frequency and repetition penalties, logit bias, banned and allowed ids: the logit
changes that depend on a request's own settings and tokens, applied in place before filtering
and drawing.

Each penalized sequence's counts stay on the device between steps (PenaltyCounts): a step uploads
the tokens its rows added since their last step, in one flat copy counted by two scatters, so it
pays the same few kernels for one penalized row or for 256. With pipelined scheduling the
last token of a decode row is still on the device (the previous launch's draw): it is counted
there, from that launch's sampled ids, so penalties never wait for the host to read it back.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterable, Sequence

import numpy as np
import torch

from nanoserve.runner.batch import SequenceWork
from nanoserve.runner.inputs import to_device
from nanoserve.sampling_params import SamplingParams


SLOT_STEP = 64


class PenaltyCounts:
    """The token counts of penalized sequences, kept on the device from one step to the next.

    Counting each row's whole history every step costs host time in proportion to its length: 11 ms
    a step for 256 rows of 1,000 tokens, 31 ms at 3,000, on a 2-core host. Kept here, a decode
    step adds each row's one new token (often still on the device, see the module docstring).
    A sequence seen for the first time is counted from its whole history. Sequences missing
    from a step are dropped, so the tables hold the rows of the largest step so far (5 bytes a
    token id each: 194 MB for 256 rows of Qwen3's vocabulary, as a fresh count needed per step).
    A row without a `seq_id` (< 0) is counted afresh every step."""

    def __init__(self) -> None:
        self.slot_of: dict[int, int] = {}   # seq_id -> row of the tables
        self.counted: dict[int, int] = {}   # seq_id -> leading tokens already counted
        self.counts: torch.Tensor | None = None   # [slots, vocab] float32: occurrences among the outputs
        self.seen: torch.Tensor | None = None     # [slots, vocab] bool: anywhere in prompt or outputs

    def _take_slots(self, keys: list[int], vocab: int, device: torch.device) -> None:
        """A slot for every key, fresh ones counted from 0; keys not listed are dropped."""
        keep = set(keys)
        for key in [k for k in self.slot_of if k not in keep]:
            del self.slot_of[key], self.counted[key]
        taken = set(self.slot_of.values())
        free = (i for i in itertools.count() if i not in taken)
        for key in keys:
            if key not in self.slot_of:
                self.slot_of[key], self.counted[key] = next(free), 0
        need = max(self.slot_of.values(), default=-1) + 1
        have = 0 if self.counts is None else self.counts.shape[0]
        if need > have:
            # whole steps of SLOT_STEP rows: few reallocations, and little held past the largest step
            counts = torch.zeros((-(-need // SLOT_STEP) * SLOT_STEP, vocab), dtype=torch.float32, device=device)
            seen = torch.zeros(counts.shape, dtype=torch.bool, device=device)
            if have:
                counts[:have], seen[:have] = self.counts, self.seen
            self.counts, self.seen = counts, seen

    def update(self, rows: list[SequenceWork], vocab: int, device: torch.device,
               prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """Bring the counts of `rows` up to the token each samples now; their slots, [rows] int64."""
        keys = [w.seq_id if w.seq_id >= 0 else -1 - i for i, w in enumerate(rows)]
        self._take_slots(keys, vocab, device)
        slots, restart, new, new_outputs, pending = [], [], [], [], []
        for key, w in zip(keys, rows):
            end = w.start + w.num_new   # the tokens before the one sampled now
            # a row without a sequence id is counted afresh every step, and so is one whose count
            # ran past its tokens (never expected: sequences only grow)
            first = 0 if key < 0 or self.counted[key] > end else self.counted[key]
            slot = self.slot_of[key]
            slots.append(slot)
            if first == 0:
                restart.append(slot)
            # what this table has not counted yet; a placeholder (< 0) stands for a pending id
            new.append(w.token_ids[first:end])
            new_outputs.append(w.token_ids[max(first, w.num_prompt_tokens):end])
            if w.prev_row >= 0 and first <= w.start:
                # its input token: an output the previous launch drew, not read back yet
                pending.append((slot, w.prev_row))
            self.counted[key] = end
        slots = np.asarray(slots, dtype=np.int64)

        def up(a) -> torch.Tensor:
            return to_device(np.asarray(a, dtype=np.int64), device)

        def flat(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
            """(slot, id) of every known id in the rows' lists."""
            which, ids = _flat(lists)
            known = ids >= 0
            return up(slots[which][known]), up(ids[known])

        if restart:
            at = up(restart)
            self.counts[at] = 0.0
            self.seen[at] = False
        at, ids = flat(new_outputs)
        self.counts.index_put_((at, ids), torch.ones(len(ids), device=device), accumulate=True)
        self.seen[flat(new)] = True
        if pending and prev_tokens is not None:
            at = up([s for s, _ in pending])
            pending_ids = prev_tokens[up([p for _, p in pending])]
            self.counts.index_put_((at, pending_ids), torch.ones(len(pending), device=device), accumulate=True)
            self.seen[at, pending_ids] = True
        return up(slots)


def token_counts(rows: list[SequenceWork], vocab: int, device: torch.device,
                 prev_tokens: torch.Tensor | None, state: PenaltyCounts | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: how often each id appears among its outputs so far ([rows, vocab] float32), and
    whether it appears anywhere in prompt or output ([rows, vocab] bool). `state` keeps the counts
    between steps (None: everything is counted now)."""
    state = state if state is not None else PenaltyCounts()
    slots = state.update(rows, vocab, device, prev_tokens)
    return state.counts[slots], state.seen[slots]


def apply_penalties(logits: torch.Tensor, rows: list[SequenceWork], prev_tokens: torch.Tensor | None = None,
                    state: PenaltyCounts | None = None, masked_rows: Collection[int] = ()) -> None:
    """Presence, frequency and repetition penalties, logit bias, banned ids and allowed ids, in place.

    `prev_tokens`: the previous launch's sampled ids, where rows with `prev_row` set find their
    pending input token. `state`: the counts kept from earlier steps (None: counted now).
    `masked_rows`: rows whose allowed ids are already in their grammar's bitmask (the engine
    folds them in there, so that a grammar and an allow list that share no token leave the
    grammar's tokens rather than none)."""
    device, vocab = logits.device, logits.shape[1]
    penalized = [i for i, w in enumerate(rows) if w.params.uses_penalties]
    if penalized:
        sub = logits[penalized]
        counts, seen = token_counts([rows[i] for i in penalized], vocab, device, prev_tokens, state)
        params = [rows[i].params for i in penalized]
        rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        # repetition penalty (prompt and output) divides positive logits and multiplies negative ones
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * counts.to(sub.dtype) - pres * (counts > 0).to(sub.dtype)
        logits[penalized] = sub
    apply_token_choices(logits, rows, masked_rows)


def apply_token_choices(logits: torch.Tensor, rows: list[SequenceWork], masked_rows: Collection[int] = ()) -> None:
    """Logit bias, banned ids and allowed ids of every row, in place: one indexed write each for
    the whole step, the ids of all rows flattened on the host (no Python loop per row or per id)."""
    device, vocab = logits.device, logits.shape[1]

    def up(a: np.ndarray) -> torch.Tensor:
        return to_device(a, device)

    biased = [i for i, w in enumerate(rows) if w.params.logit_bias]
    if biased:
        # one row of biases per distinct bias (a request's n choices share theirs), added to each
        # row that has it: the entries go up once, not once per row
        first, group = _distinct(rows, biased, lambda p: p.logit_bias)
        arrays = [rows[i].params.logit_bias_arrays for i in first]
        which, ids = _flat_arrays([a[0] for a in arrays])
        values = np.concatenate([a[1] for a in arrays])
        # an id outside the vocabulary has no logit to move (clamping it would bias the last token)
        known = (ids >= 0) & (ids < vocab)
        dense = torch.zeros((len(first), vocab), dtype=logits.dtype, device=device)
        dense.index_put_((up(which[known]), up(ids[known])), up(values[known]).to(logits.dtype), accumulate=True)
        # (a [rows, vocab] gather only where choices share a bias: the same size as the logits)
        per_row = dense[up(group)] if len(first) < len(biased) else dense
        logits.index_add_(0, up(np.asarray(biased, dtype=np.int64)), per_row)
    banned = [i for i, w in enumerate(rows) if w.banned_token_ids]
    if banned:
        which, ids = _flat([rows[i].banned_token_ids for i in banned])
        logits[up(np.asarray(banned, dtype=np.int64)[which]), up(ids)] = float("-inf")
    masked = set(masked_rows)
    limited = [i for i, w in enumerate(rows) if w.params.allowed_token_ids is not None and i not in masked]
    if limited:
        # last: no bias or penalty can bring a token outside the list back
        first, group = _distinct(rows, limited, lambda p: p.allowed_token_ids)
        which, ids = _flat_arrays([rows[i].params.allowed_token_ids_array for i in first])
        known = (ids >= 0) & (ids < vocab)
        allowed = torch.zeros((len(first), vocab), dtype=torch.bool, device=device)
        allowed[up(which[known]), up(ids[known])] = True
        blocked = ~allowed[up(group)]
        if len(limited) == len(rows):
            logits.masked_fill_(blocked, float("-inf"))
        else:
            at = up(np.asarray(limited, dtype=np.int64))
            logits[at] = logits[at].masked_fill(blocked, float("-inf"))


def _distinct(rows: list[SequenceWork], indices: list[int], field: Callable[[SamplingParams], object]
              ) -> tuple[list[int], np.ndarray]:
    """The rows (of `indices`) whose params hold distinct `field` objects, the first of each, and
    per index the position of its object among those: forks share their request's objects."""
    position: dict[int, int] = {}
    first: list[int] = []
    group = np.empty(len(indices), dtype=np.int64)
    for k, i in enumerate(indices):
        key = id(field(rows[i].params))
        if key not in position:
            position[key] = len(first)
            first.append(i)
        group[k] = position[key]
    return first, group


def _flat_arrays(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(index of its array, id) of every id in the arrays, as two int64 arrays."""
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    return np.repeat(np.arange(len(arrays), dtype=np.int64), lengths), np.concatenate(arrays)


def _flat(lists: Sequence[Iterable[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(index of its list, id) of every id in the lists, as two int64 arrays."""
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    ids = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(lengths.sum()))
    return np.repeat(np.arange(len(lists), dtype=np.int64), lengths), ids
