"""Flattens a step's sequences into the packed tensors the model and attention read."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from nanoserve.runner.batch import AttentionMetadata, SequenceWork

S = TypeVar("S", bound="PinnedSet")
FEW_TABLES = 4   # up to this many, a row at a time beats the vectorized scatter's fixed cost


@dataclass
class PromptLogprobRows:
    """The rows whose logits score the next prompt token, for sequences that asked (prompt logprobs)."""

    rows: torch.Tensor      # [R] int64 indices into the packed hidden states
    targets: torch.Tensor   # [R] int64, the prompt token each row predicts
    counts: list[int]       # rows of each asking sequence, in work order
    top_n: list[int]        # top alternatives each asking sequence wants


@dataclass
class StepInputs:
    """Packed (no padding) inputs of one step; sequence i owns rows query_start_loc[i]:[i+1]."""

    input_ids: torch.Tensor       # [tokens] int64
    positions: torch.Tensor       # [tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [sampling rows] int64, the last query row of each sampling sequence
    sample_rows: list[SequenceWork]
    prompt_logprob_rows: PromptLogprobRows | None = None


class PinnedSet:
    """A set of pinned host buffers behind a graph's static inputs, and the event after their last upload."""

    def __init__(self, pin: bool) -> None:
        self.uploaded = torch.cuda.Event() if pin else None

    def mark_uploaded(self) -> None:
        if self.uploaded is not None:
            self.uploaded.record()


class PinnedSets(Generic[S]):
    """Two pinned sets, used in turn. A launch may be queued behind the step in flight, so its
    upload can still be pending when the host stages the next step: a set is handed out again only
    after its previous upload has run (with two, that wait is rare)."""

    def __init__(self, make: Callable[[], S]) -> None:
        self.sets = (make(), make())
        self.turn = 0

    def next_free(self) -> S:
        host = self.sets[self.turn]
        self.turn ^= 1
        if host.uploaded is not None:
            host.uploaded.synchronize()  # a never-recorded event returns at once
        return host


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        # pinned staging lets the copy run asynchronously to the host
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def write_block_tables(out: np.ndarray, work: list[SequenceWork]) -> None:
    """Each sequence's block table into its row of `out`; entries past a table's end are left alone."""
    tables = [w.block_table for w in work]
    if len(tables) <= FEW_TABLES:
        for row, table in zip(out, tables):
            row[:len(table)] = table
        return
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = int(lengths.max())
    # one vectorized scatter: a row-major boolean mask visits the entries in chain order
    out[:len(tables), :width][np.arange(width)[None, :] < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), dtype=out.dtype, count=int(lengths.sum()))


def block_table_array(work: list[SequenceWork], width: int) -> np.ndarray:
    table = np.full((len(work), width), -1, dtype=np.int32)
    write_block_tables(table, work)
    return table


def decode_columns(work: list[SequenceWork], block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token id, position and cache slot of each sequence's single new token."""
    n = len(work)
    ids = np.fromiter((w.token_ids[w.start] for w in work), dtype=np.int64, count=n)
    positions = np.fromiter((w.start for w in work), dtype=np.int64, count=n)
    slots = np.fromiter((w.block_table[w.start // block_size] * block_size + w.start % block_size
                         for w in work), dtype=np.int64, count=n)
    return ids, positions, slots


def fill_pending_tokens(input_ids: torch.Tensor, work: list[SequenceWork], first_rows: np.ndarray | None,
                        prev_tokens: torch.Tensor | None) -> None:
    """Put the previous launch's sampled ids (still on the device) where the host had placeholders.

    A pending token is always a sequence's first new token: its row is first_rows[i] (row i
    when None, as in a decode step)."""
    pending = [i for i, w in enumerate(work) if w.prev_row >= 0]
    if not pending:
        return
    rows = pending if first_rows is None else [int(first_rows[i]) for i in pending]
    index = torch.tensor(rows, dtype=torch.int64).to(input_ids.device, non_blocking=True)
    source = torch.tensor([work[i].prev_row for i in pending], dtype=torch.int64)
    input_ids[index] = prev_tokens[source.to(input_ids.device, non_blocking=True)]


def build_inputs(work: list[SequenceWork], block_size: int, device: torch.device,
                 prev_tokens: torch.Tensor | None = None) -> StepInputs:
    query_lens = [w.num_new for w in work]
    seq_lens = [w.start + w.num_new for w in work]
    if max(query_lens) == 1:
        ids, positions, slots = decode_columns(work, block_size)
    else:
        ids = np.concatenate([np.asarray(w.token_ids[w.start:w.start + w.num_new], dtype=np.int64) for w in work])
        positions = np.concatenate([np.arange(w.start, w.start + w.num_new, dtype=np.int64) for w in work])
        slots = np.concatenate([np.asarray(w.block_table, dtype=np.int64)[p // block_size] * block_size
                                + p % block_size
                                for w, p in zip(work, np.split(positions, np.cumsum(query_lens)[:-1]))])
    query_start = np.zeros(len(work) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start[1:])
    width = max(len(w.block_table) for w in work)
    sample_rows = [w for w in work if w.params is not None]
    logits_indices = np.asarray([query_start[i + 1] - 1 for i, w in enumerate(work) if w.params is not None],
                                dtype=np.int64)
    meta = AttentionMetadata(
        slot_mapping=to_device(slots, device),
        query_start_loc=to_device(query_start, device),
        seq_lens=to_device(np.asarray(seq_lens, dtype=np.int32), device),
        block_tables=to_device(block_table_array(work, width), device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    input_ids = to_device(ids, device)
    fill_pending_tokens(input_ids, work, query_start, prev_tokens)
    return StepInputs(input_ids, to_device(positions, device), meta, to_device(logits_indices, device),
                      sample_rows, prompt_logprob_rows(work, query_start, device))


def prompt_logprob_rows(work: list[SequenceWork], query_start: np.ndarray,
                        device: torch.device) -> PromptLogprobRows | None:
    """Row p - start of a chunk scores token p + 1, for every p before the prompt's last token."""
    asks = [(i, w) for i, w in enumerate(work) if w.prompt_logprobs is not None]
    if not asks:
        return None
    rows, targets, counts = [], [], []
    for i, w in asks:
        end = max(min(w.start + w.num_new, w.num_prompt_tokens - 1), w.start)
        rows.append(np.arange(query_start[i], query_start[i] + end - w.start, dtype=np.int64))
        targets.append(np.asarray(w.token_ids[w.start + 1:end + 1], dtype=np.int64))
        counts.append(end - w.start)
    return PromptLogprobRows(to_device(np.concatenate(rows), device), to_device(np.concatenate(targets), device),
                             counts, [w.prompt_logprobs for _, w in asks])
