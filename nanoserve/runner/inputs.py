"""Flattens a step's sequences into the packed tensors the model and attention read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.runner.batch import AttentionMetadata, SequenceWork


@dataclass
class StepInputs:
    """Packed (no padding) inputs of one step; sequence i owns rows query_start_loc[i]:[i+1]."""

    input_ids: torch.Tensor       # [tokens] int64
    positions: torch.Tensor       # [tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [sampling rows] int64, the last query row of each sampling sequence
    sample_rows: list[SequenceWork]


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        # pinned staging lets the copy run asynchronously to the host
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def block_table_array(work: list[SequenceWork], width: int) -> np.ndarray:
    table = np.full((len(work), width), -1, dtype=np.int32)
    for i, w in enumerate(work):
        table[i, :len(w.block_table)] = w.block_table
    return table


def fill_pending_tokens(input_ids: torch.Tensor, rows: list[int], prev_rows: list[int],
                        prev_tokens: torch.Tensor | None) -> None:
    """Put the previous launch's sampled ids (still on the device) where the host had placeholders."""
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.int64).to(input_ids.device, non_blocking=True)
    source = torch.tensor(prev_rows, dtype=torch.int64).to(input_ids.device, non_blocking=True)
    input_ids[index] = prev_tokens[source]


def build_inputs(work: list[SequenceWork], block_size: int, device: torch.device,
                 prev_tokens: torch.Tensor | None = None) -> StepInputs:
    query_lens = [w.num_new for w in work]
    seq_lens = [w.start + w.num_new for w in work]
    if max(query_lens) == 1:
        ids = np.fromiter((w.token_ids[w.start] for w in work), dtype=np.int64, count=len(work))
        positions = np.fromiter((w.start for w in work), dtype=np.int64, count=len(work))
        slots = np.fromiter((w.block_table[w.start // block_size] * block_size + w.start % block_size
                             for w in work), dtype=np.int64, count=len(work))
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
        slot_mapping=_to_device(slots, device),
        query_start_loc=_to_device(query_start, device),
        seq_lens=_to_device(np.asarray(seq_lens, dtype=np.int32), device),
        block_tables=_to_device(block_table_array(work, width), device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    input_ids = _to_device(ids, device)
    pending = [i for i, w in enumerate(work) if w.prev_row >= 0]
    fill_pending_tokens(input_ids, [int(query_start[i]) for i in pending], [work[i].prev_row for i in pending],
                        prev_tokens)
    return StepInputs(input_ids, _to_device(positions, device), meta, _to_device(logits_indices, device),
                      sample_rows)
