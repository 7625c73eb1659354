"""CUDA graphs of the decode forward pass, one per batch-size bucket, over static buffers."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.runner.batch import AttentionMetadata, SequenceWork
from nanoserve.runner.inputs import fill_pending_tokens

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to max_num_seqs (at most 512)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [s for s in (1, 2, 4, 8) if s < top] + list(range(16, top, 16)) + [top]
    return sorted(set(sizes))


class DecodeGraphs:
    """Replays a captured decode step for any batch of single-token sequences that fits a bucket.

    Inputs are written into a pinned host staging area and copied to the static device buffers
    in one transfer. Rows past the real batch are padding: slot -1 writes no K/V and seq_len 0
    reads none, so their outputs are garbage that nobody looks at.
    """

    def __init__(self, model: nn.Module, config: EngineConfig, show_progress: bool = False) -> None:
        self.model = model
        self.block_size = config.block_size
        self.sizes = graph_batch_sizes(config.max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-config.max_model_len // config.block_size)
        self.max_model_len = config.max_model_len
        device = torch.device(config.device)
        n = self.max_batch
        # one int64 staging row each for token ids, positions, slots; int32 for lens and tables
        self.host_i64 = torch.zeros((3, n), dtype=torch.int64, pin_memory=True)
        self.host_i32 = torch.zeros((n, 1 + self.max_blocks), dtype=torch.int32, pin_memory=True)
        self.np_i64 = self.host_i64.numpy()
        self.np_i32 = self.host_i32.numpy()
        self.dev_i64 = torch.zeros((3, n), dtype=torch.int64, device=device)
        self.dev_i32 = torch.zeros((n, 1 + self.max_blocks), dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture(show_progress)

    def _meta(self, batch: int) -> AttentionMetadata:
        seq_lens = self.dev_i32[:batch, 0]
        return AttentionMetadata(
            slot_mapping=self.dev_i64[2, :batch],
            query_start_loc=self.query_start[:batch + 1],
            seq_lens=seq_lens,
            block_tables=self.dev_i32[:batch, 1:],
            max_query_len=1,
            # sizes the decode kernel's split count for any context the graph may later see
            max_seq_len=self.max_model_len,
            query_lens_host=[1] * batch,
            seq_lens_host=[self.max_model_len] * batch,
        )

    def _forward(self, batch: int) -> torch.Tensor:
        return self.model(self.dev_i64[0, :batch], self.dev_i64[1, :batch], self._meta(batch))

    @torch.inference_mode()
    def _capture(self, show_progress: bool) -> None:
        # capture runs read real cache memory: make every row a 1-token sequence in block 0
        self.dev_i64.zero_()
        self.dev_i32.zero_()
        self.dev_i32[:, 0] = 1
        pool = None
        for batch in tqdm(reversed(self.sizes), total=len(self.sizes), desc="Capturing CUDA graphs",
                          disable=not show_progress):
            self._forward(batch)  # warm-up: autotuning and lazy init stay out of the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self._forward(batch)
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def fits(self, work: list[SequenceWork]) -> bool:
        return len(work) <= self.max_batch and all(w.num_new == 1 and w.params is not None for w in work)

    def run(self, work: list[SequenceWork], prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [len(work), hidden] of one decode step; `prev_tokens` fill pending ids."""
        n = len(work)
        batch = next(s for s in self.sizes if s >= n)
        bs, i64, i32 = self.block_size, self.np_i64, self.np_i32
        i64[0, :n] = [w.token_ids[w.start] for w in work]
        i64[1, :n] = [w.start for w in work]
        i64[2, :n] = [w.block_table[w.start // bs] * bs + w.start % bs for w in work]
        i64[2, n:batch] = -1
        i32[:n, 0] = [w.start + 1 for w in work]
        i32[n:batch, 0] = 0
        tables = [w.block_table for w in work]
        lengths = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        # one vectorized scatter of all tables: row-major mask order is the chain order
        width = int(lengths.max())
        i32[:n, 1:1 + width][np.arange(width)[None, :] < lengths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
        self.dev_i64[:, :batch].copy_(self.host_i64[:, :batch], non_blocking=True)
        self.dev_i32[:batch].copy_(self.host_i32[:batch], non_blocking=True)
        pending = [i for i, w in enumerate(work) if w.prev_row >= 0]
        fill_pending_tokens(self.dev_i64[0], pending, [work[i].prev_row for i in pending], prev_tokens)
        self.graphs[batch].replay()
        return self.outputs[batch][:n]
