"""CUDA graphs of the decode step, one per batch-size bucket, over static buffers.

On one rank a graph holds the whole step: the forward pass, the LM head and a Gumbel-max draw
(temperature only). The runner takes that draw when every row asks for no more; otherwise it
samples the graph's logits as it samples any step's."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.runner.attention.decode_splits import longest_first_enabled
from nanoserve.runner.batch import AttentionMetadata, SequenceWork
from nanoserve.runner.layers.linear import building_graphs
from nanoserve.runner.inputs import PinnedSet, PinnedSets, decode_columns, fill_pending_tokens, write_block_tables
from nanoserve.runner.sampling_kernel import gumbel_argmax_scaled, inverse_temperature

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to max_num_seqs (at most 512)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [s for s in (1, 2, 4, 8) if s < top] + list(range(16, top, 16)) + [top]
    return sorted(set(sizes))


def logits_buffer_bytes(config: EngineConfig, vocab_size: int) -> int:
    """The decode graphs' logits buffer (with in-graph draws), which stays allocated: KV sizing
    counts it beside the profiled peak, which holds only a step's transient logits."""
    return graph_batch_sizes(config.max_num_seqs)[-1] * vocab_size * config.dtype.itemsize


class HostStaging(PinnedSet):
    """One pinned copy of a decode step's inputs on the host."""

    def __init__(self, n: int, max_blocks: int, pin: bool) -> None:
        super().__init__(pin)
        self.i64 = torch.zeros((4, n), dtype=torch.int64, pin_memory=pin)
        i32 = torch.zeros(n * (2 + max_blocks), dtype=torch.int32, pin_memory=pin)
        self.lens_order, self.tables = i32[:2 * n].view(2, n), i32[2 * n:].view(n, max_blocks)
        self.inv_temp = torch.zeros(n, dtype=torch.float32, pin_memory=pin)


class DecodeBuffers:
    """The static inputs a captured decode graph reads, and the pinned host staging behind them.

    Rows past the real batch are padding: slot -1 writes no K/V and seq_len 0 reads none.
    """

    def __init__(self, max_batch: int, max_blocks: int, max_model_len: int, block_size: int,
                 device: torch.device, seed: int = 0, draws: bool = True, fp8_cache: bool = False) -> None:
        """`draws`: stage the in-graph draw's inputs too (1 / T and noise seeds)."""
        self.block_size = block_size
        self.draws = draws
        self.max_model_len = max_model_len
        n = max_batch
        # two host sets, used in turn, so staging a step never waits for the one in flight
        self.staging = PinnedSets(lambda: HostStaging(n, max_blocks, device.type == "cuda"))
        # int64 rows: token ids, positions, slots, and the draw's noise seeds
        self.dev_i64 = torch.zeros((4, n), dtype=torch.int64, device=device)
        self.dev_inv_temp = torch.zeros(n, dtype=torch.float32, device=device)
        # numpy takes no negative seed; torch reads -1 as 2**64 - 1, and so does this
        self.rng = np.random.default_rng(seed % 2**64)
        # int32: n seq lens, the rows longest first, then n block-table rows; lens and tables
        # contiguous (flash-attn wants that)
        dev_i32 = torch.zeros(n * (2 + max_blocks), dtype=torch.int32, device=device)
        self.dev_lens_order, self.dev_tables = dev_i32[:2 * n].view(2, n), dev_i32[2 * n:].view(n, max_blocks)
        self.longest_first = longest_first_enabled(fp8_cache)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)

    def meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.dev_i64[2, :batch],
            query_start_loc=self.query_start[:batch + 1],
            seq_lens=self.dev_lens_order[0, :batch],
            block_tables=self.dev_tables[:batch],
            max_query_len=1,
            # sizes the decode kernel's split count for any context the graph may later see
            max_seq_len=self.max_model_len,
            query_lens_host=[1] * batch,
            seq_lens_host=[self.max_model_len] * batch,
            decode_order=self.dev_lens_order[1, :batch] if self.longest_first else None,
        )

    def stage(self, work: list[SequenceWork], batch: int, prev_tokens: torch.Tensor | None) -> None:
        """Write one decode step of len(work) <= batch sequences into the first `batch` rows."""
        host = self.staging.next_free()
        n = len(work)
        i64, lens = host.i64.numpy(), host.lens_order[0].numpy()
        i64[0, :n], i64[1, :n], i64[2, :n] = decode_columns(work, self.block_size)
        # padding rows: token 0 at position 0 (a stale placeholder id would index out of the
        # embedding), slot -1 writes nothing
        i64[:2, n:batch] = 0
        i64[2, n:batch] = -1
        lens[:n] = i64[1, :n] + 1
        lens[n:batch] = 0
        if self.longest_first:
            host.lens_order[1].numpy()[:batch] = np.argsort(-lens[:batch], kind="stable")
        write_block_tables(host.tables.numpy(), work)
        if self.draws:   # padding rows draw greedily
            i64[3, :batch] = self.rng.integers(0, 2**31 - 1, batch)
            host.inv_temp[:n] = inverse_temperature(
                torch.tensor([w.params.temperature for w in work], dtype=torch.float32))
            host.inv_temp[n:batch] = 0.0
            self.dev_inv_temp[:batch].copy_(host.inv_temp[:batch], non_blocking=True)
        self.dev_i64[:, :batch].copy_(host.i64[:, :batch], non_blocking=True)
        self.dev_lens_order[0, :batch].copy_(host.lens_order[0, :batch], non_blocking=True)
        if self.longest_first:   # two contiguous rows: a strided [2, batch] slice would not copy asynchronously
            self.dev_lens_order[1, :batch].copy_(host.lens_order[1, :batch], non_blocking=True)
        self.dev_tables[:batch].copy_(host.tables[:batch], non_blocking=True)
        host.mark_uploaded()
        fill_pending_tokens(self.dev_i64[0], work, None, prev_tokens)

    def reset_for_capture(self) -> None:
        # capture runs read real cache memory: make every row a 1-token sequence in block 0
        self.dev_i64.zero_()
        self.dev_tables.zero_()
        self.dev_lens_order[0].fill_(1)
        self.dev_lens_order[1].copy_(torch.arange(self.dev_lens_order.shape[1]))


class DecodeGraphs:
    """Replays a captured decode step for any batch of single-token sequences that fits a bucket.

    With `draws` (one rank) a replay yields logits and the in-graph draw; otherwise hidden states."""

    def __init__(self, model: nn.Module, config: EngineConfig, show_progress: bool = False,
                 draws: bool = False) -> None:
        self.model = model
        self.draws = draws
        self.sizes = graph_batch_sizes(config.max_num_seqs)
        self.max_batch = self.sizes[-1]
        device = torch.device(config.device)
        self.buffers = DecodeBuffers(self.max_batch, -(-config.max_model_len // config.block_size),
                                     config.max_model_len, config.block_size, device, config.seed, draws,
                                     config.kv_cache_dtype == "fp8")
        # every bucket's logits in one buffer: per-graph outputs of [batch, vocab] would add up
        self.logits = torch.empty((self.max_batch, model.config.vocab_size), dtype=config.dtype,
                                  device=device) if draws else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.drawn: dict[int, torch.Tensor] = {}
        self._capture(show_progress)

    def _step(self, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        b = self.buffers
        hidden = self.model(b.dev_i64[0, :batch], b.dev_i64[1, :batch], b.meta(batch))
        if not self.draws:
            return hidden, None
        logits = self.model.compute_logits(hidden, out=self.logits[:batch])
        return logits, gumbel_argmax_scaled(logits, b.dev_inv_temp[:batch], b.dev_i64[3, :batch])

    @torch.inference_mode()
    def _capture(self, show_progress: bool) -> None:
        self.buffers.reset_for_capture()
        pool = None
        with building_graphs():   # the linear layers' skinny kernels run in graphs only
            for batch in tqdm(reversed(self.sizes), total=len(self.sizes), desc="Capturing CUDA graphs",
                              disable=not show_progress):
                self._step(batch)  # warm-up: autotuning and lazy init stay out of the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[batch], drawn = self._step(batch)
                if drawn is not None:
                    self.drawn[batch] = drawn
                pool = graph.pool()
                self.graphs[batch] = graph
        torch.cuda.synchronize()

    def fits(self, work: list[SequenceWork]) -> bool:
        return len(work) <= self.max_batch and all(w.num_new == 1 and w.params is not None for w in work)

    def run(self, work: list[SequenceWork], prev_tokens: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of len(work) rows; `prev_tokens` fill pending ids. Returns the logits
        and the in-graph draw (with `draws`), or the hidden states and None.

        Both are views of static buffers: the next replay overwrites the logits (one buffer serves
        every bucket) and the next replay of this bucket the draw. In stream order every reader of
        this step's tensors runs before either."""
        batch = next(s for s in self.sizes if s >= len(work))
        self.buffers.stage(work, batch, prev_tokens)
        self.graphs[batch].replay()
        n = len(work)
        drawn = self.drawn.get(batch)
        return self.outputs[batch][:n], (drawn[:n] if drawn is not None else None)
