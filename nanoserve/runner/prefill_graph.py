"""CUDA graphs of prefill and mixed steps (prompts beside decode rows), padded to a token-count bucket.

An eager prefill pays a Python launch for every kernel of every layer; for a 1k-token prompt
alone that host time was ~4x the GPU's (bench/prefill.py --profile), and a served step that
admits a prompt beside running streams stalled all of them as long. A graph replays the whole
forward pass, up to the last hidden states, for any step of at most max_num_seqs sequences (up to
MAX_GRAPH_SEQS) and at most the largest bucket's tokens. The LM head and sampling run after it,
as they do after an eager forward.

Static inputs, and what padding means in them:
- tokens past the step's own: id 0 at position 0, cache slot -1 (nothing stored), and no sequence
  owns them, so attention never writes their rows; every other layer works row by row, so
  whatever those rows hold stays in them and nobody reads them;
- sequences past the step's own: zero queries (query_start_loc repeats the total) and zero keys.
The prefill attention kernel runs over a staged list of (sequence, query tile) programs
(triton_prefill.prefill_tiles): a bucket of T tokens over S sequences needs at most
T / BLOCK_Q + S of them, whatever the split of its tokens, so one capture serves any step that fits.
Decode rows (one-token sequences) have no tiles: the decode kernel takes them, over every sequence
of the buffers, as in an eager mixed step (triton_kernels).

Each bucket has two graphs. The mixed one holds up to max_seqs sequences. The prompts-only one
holds up to PROMPT_GRAPH_SEQS sequences of more than one query each, and has no decode launch: a
lone prompt would otherwise pay, every layer, a decode launch of max_seqs x kv-heads programs that
return at once and max_seqs empty prefill programs (graphs sized for 256 sequences took a lone 1k
prompt from 4.03 to 4.68 ms on an H200).

A bucket whose steps can leave SMs idle (model_split_buckets) has split variants of both, replayed
when the staged plan cuts long tiles' keys over more programs (prefill_splits.py): a turn after a
long cached history, alone or beside running streams.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.positions import layer_windows
from nanoserve.runner.attention.decode_splits import num_sms
from nanoserve.runner.attention.prefill_splits import PLAN_SIZE, PrefillSplits, SplitShape, plan_splits, split_unit
from nanoserve.runner.attention.triton_prefill import LONGEST_FIRST, prefill_tile_rows, prefill_tiles
from nanoserve.runner.batch import AttentionMetadata, SequenceWork
from nanoserve.runner.inputs import PinnedSet, PinnedSets, fill_pending_tokens, write_block_tables
from nanoserve.runner.layers.linear import building_graphs
from nanoserve.runner.models.decoder import head_dim_of

MAX_GRAPH_SEQS = 512        # sequences a graphed step may hold (and max_num_seqs, where lower)
PROMPT_GRAPH_SEQS = 16      # sequences of a prompts-only graph: its empty programs stay within a wave
SMALLEST_BUCKET = 16
STEP_PAST_1K = 1024         # buckets double up to 1k tokens, then grow by 1k: padding stays under 1k
# past it a step's GPU time hides its launches (a lone 4k prompt: 22 ms eager, 18 graphed; 16k:
# ~55 ms of GPU time), while every bucket more costs capture time at each start
LARGEST_BUCKET = 8192
PADDING = np.array([[0], [0], [-1]], dtype=np.int64)   # a padding row: id 0 at position 0, stored nowhere


def prefill_token_buckets(max_tokens: int) -> list[int]:
    """Token counts a graph is captured for: 16, 32, ..., 1024, then steps of 1024, up to
    max_tokens or LARGEST_BUCKET; larger steps run eagerly."""
    top = min(max_tokens, LARGEST_BUCKET)
    sizes, size = [], SMALLEST_BUCKET
    while size < min(top, STEP_PAST_1K):
        sizes.append(size)
        size *= 2
    sizes += list(range(STEP_PAST_1K, top, STEP_PAST_1K))
    return sorted(set(sizes + [top]))


def split_shape(config: EngineConfig) -> SplitShape:
    """How the prefill graphs of `config`'s model split a small step's keys (prefill_splits.py)."""
    hf, device = config.hf_config, torch.device(config.device)
    head_dim = head_dim_of(hf)
    block_m, block_q = prefill_tile_rows(hf.num_attention_heads, hf.num_key_value_heads, head_dim, config.dtype,
                                         device)
    return SplitShape(split_unit(device), hf.num_key_value_heads, num_sms(device), block_m, block_q, head_dim)


def split_buckets(sizes: list[int], shape: SplitShape) -> list[int]:
    """The buckets whose smallest step (one token past the bucket below) may be split."""
    return [bucket for below, bucket in zip([1] + sizes, sizes) if shape.may_split(below + 1)]


def model_split_buckets(config: EngineConfig) -> list[int]:
    """The buckets that get a split graph for `config`'s model: none where a layer has a sliding
    window, which bounds each row's keys already (the kernel splits none)."""
    if any(layer_windows(config.hf_config, config.max_model_len)):
        return []
    return split_buckets(prefill_token_buckets(config.max_num_batched_tokens), split_shape(config))


def prefill_graph_bytes(config: EngineConfig, hidden_size: int, activation_peak: int) -> int:
    """What the prefill graphs keep allocated, for KV sizing: their pool holds the largest bucket's
    activations (at most the profiled peak of a full token budget), every graph's output (two a
    bucket, four where a step may be split) and the splits' scratch."""
    split = model_split_buckets(config)
    outputs = 2 * (sum(prefill_token_buckets(config.max_num_batched_tokens)) + sum(split)) * hidden_size
    scratch = 0
    if split:
        shape = split_shape(config)
        scratch = PrefillSplits.scratch_bytes(shape.kv_heads, shape.block_m, shape.head_dim)
    return activation_peak + outputs * config.dtype.itemsize + scratch


def fits_prefill_graph(work: list[SequenceWork], max_tokens: int, max_seqs: int) -> bool:
    """A step the graphs can run: at most max_seqs sequences, no prompt logprobs (they read every
    row's logits), and at most the largest bucket's tokens."""
    return (len(work) <= max_seqs and sum(w.num_new for w in work) <= max_tokens
            and all(w.prompt_logprobs is None for w in work))


class PrefillStaging(PinnedSet):
    """One pinned copy of a prefill step's inputs on the host, laid out as the device buffers are,
    with its numpy views made once: a lone prompt's staging is host time before its graph starts."""

    def __init__(self, int64s: int, int32s: int, pin: bool, int32_views: Callable) -> None:
        super().__init__(pin)
        self.i64 = torch.zeros(int64s, dtype=torch.int64, pin_memory=pin)
        self.i32 = torch.zeros(int32s, dtype=torch.int32, pin_memory=pin)
        self.i64_np = self.i64.numpy()
        views = int32_views(self.i32)
        self.block_tables = views[4]
        self.query_start, self.seq_lens, self.split_plan, self.tiles, self.tables = (v.numpy() for v in views)


class PrefillBuffers:
    """The static inputs of the prefill graphs: token rows for the largest bucket, max_seqs
    sequences of up to max_model_len keys, and the attention kernel's program list; and the
    pinned host copies a step is written into, so that staging is a handful of uploads."""

    def __init__(self, max_tokens: int, max_blocks: int, device: torch.device, max_seqs: int,
                 block_q: int, max_model_len: int, block_size: int, splitting: SplitShape | None = None) -> None:
        """block_q: the prefill kernel's query tokens per program (prefill_block_q), which the
        staged program list counts in. splitting: how split steps are planned (None: never)."""
        n, s = max_tokens, max_seqs
        self.block_q, self.block_size = block_q, block_size
        self.splitting = splitting
        self.max_seqs, self.max_blocks = s, max_blocks
        self.max_model_len = max_model_len
        # int64, for a bucket of b tokens: ids, positions and cache slots in rows of b (token_rows),
        # then the sampling rows (each sampling sequence's last query row): one upload
        self.i64 = torch.zeros(3 * n + s, dtype=torch.int64, device=device)
        # int32 in one tensor, so one upload covers all but the tables: query starts, seq lens,
        # the split plan, the kernel's programs, then the block tables
        self.plan_size = PLAN_SIZE if splitting else 0
        self.max_tiles = self.num_tiles(n, s, split=splitting is not None)
        self.int32s = torch.zeros(2 * s + 1 + self.plan_size + self.max_tiles + s * max_blocks, dtype=torch.int32,
                                  device=device)
        self.query_start, self.seq_lens, split_plan, self.tiles, self.block_tables = self._int32_views(self.int32s)
        self.tiles_at = self.tiles.storage_offset()   # the int32 values ahead of the programs, uploaded with them
        self.splits = (PrefillSplits.allocate(split_plan, splitting.kv_heads, splitting.block_m, splitting.head_dim)
                       if splitting else None)
        self.tiles.fill_(-1)
        pin = device.type == "cuda"
        self.staging = PinnedSets(lambda: PrefillStaging(self.i64.shape[0], self.int32s.shape[0], pin,
                                                         self._int32_views))

    def _int32_views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Query starts, seq lens, the split plan, the programs, the block tables."""
        s = self.max_seqs
        *head, tables = flat.split([s + 1, s, self.plan_size, self.max_tiles, s * self.max_blocks])
        return (*head, tables.view(s, self.max_blocks))

    def token_rows(self, bucket: int, flat: torch.Tensor | None = None) -> torch.Tensor:
        """[3, bucket]: the ids, positions and cache slots a bucket's graph reads (of `flat`, a
        host copy, when given)."""
        return (self.i64 if flat is None else flat)[:3 * bucket].view(3, bucket)

    def num_tiles(self, bucket: int, seqs: int, split: bool = False) -> int:
        """Programs a bucket's step over `seqs` sequences may need: each one's last tile may be
        partial; a split step's parts take more."""
        tiles = -(-bucket // self.block_q) + min(seqs, bucket)
        return max(tiles, self.splitting.list_room()) if split else tiles

    def meta(self, bucket: int, seqs: int, prompts_only: bool = False, split: bool = False) -> AttentionMetadata:
        """The graph's view of the first `seqs` sequences; `prompts_only`: no decode launch;
        `split`: its long tiles may be split (prefill_splits.py)."""
        return AttentionMetadata(
            slot_mapping=self.token_rows(bucket)[2],
            query_start_loc=self.query_start[:seqs + 1],
            seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs],
            max_query_len=bucket,
            max_seq_len=self.max_model_len,   # sizes the decode rows' split count for any context
            # the bucket's rows, all "owned": the kernel leaves padding rows as they are
            query_lens_host=[bucket],
            seq_lens_host=[bucket],
            prefill_tiles=self.tiles[:self.num_tiles(bucket, seqs, split)],
            split_decode_rows=not prompts_only,
            prefill_splits=self.splits if split else None,
        )

    def clear(self, bucket: int) -> None:
        """Every row padding, every sequence empty: what capture runs over (it stores nothing)."""
        rows = self.token_rows(bucket)
        rows[:2].zero_()      # id 0 at position 0
        rows[2].fill_(-1)     # stored nowhere
        self.query_start.zero_()
        self.seq_lens.zero_()
        self.tiles.fill_(-1)
        if self.splits is not None:
            self.splits.merges.fill_(-1)

    def stage(self, work: list[SequenceWork], bucket: int, seqs: int, prev_tokens: torch.Tensor | None = None,
              may_split: bool = False) -> tuple[torch.Tensor, list[SequenceWork], bool]:
        """Write a step of len(work) <= seqs sequences into the first rows, padding the rest, for the
        graph of `seqs` sequences over `bucket` tokens; `prev_tokens` fill pending ids; `may_split`:
        plan splits where the step is small. Returns the device indices of the sampling rows, their
        sequences, and whether the step was split (its split graph must run it)."""
        host = self.staging.next_free()
        count, num = self.num_tiles(bucket, seqs, may_split), len(work)
        rows = host.i64_np[:3 * bucket].reshape(3, bucket)   # ids, positions, cache slots
        query_start, seq_lens, tables = host.query_start, host.seq_lens, host.tables
        lens = [w.num_new for w in work]
        starts = np.array([w.start for w in work], dtype=np.int64)
        query_start[0] = 0
        np.cumsum(lens, out=query_start[1:num + 1])
        n = int(query_start[num])
        query_start[num + 1:seqs + 1] = n
        seq_lens[:num] = starts + lens
        seq_lens[num:seqs] = 0
        write_block_tables(tables, work)
        if num == 1:   # a lone prompt: its positions run on from its start
            rows[0, :n] = work[0].token_ids[work[0].start:work[0].start + n]
            positions = np.arange(starts[0], starts[0] + n)
            blocks = tables[0, positions // self.block_size]
        else:
            owner = np.repeat(np.arange(num), lens)
            positions = np.arange(n) + np.repeat(starts - query_start[:num], lens)
            rows[0, :n] = np.fromiter(itertools.chain.from_iterable(w.token_ids[w.start:w.start + w.num_new]
                                                                    for w in work), dtype=np.int64, count=n)
            blocks = tables[owner, positions // self.block_size]
        rows[1, :n] = positions
        np.multiply(blocks, self.block_size, out=rows[2, :n], dtype=np.int64)
        rows[2, :n] += positions % self.block_size
        rows[:, n:] = PADDING   # id 0 at position 0, stored nowhere
        sampling = [w for w in work if w.params is not None]
        if len(sampling) == num:
            last_rows = query_start[1:num + 1] - 1
        else:
            last_rows = query_start[1:num + 1][[w.params is not None for w in work]] - 1
        uploaded = 3 * bucket + len(last_rows)
        host.i64_np[3 * bucket:uploaded] = last_rows
        entries = prefill_tiles(lens, self.block_q, host.tiles[:count], seq_lens if LONGEST_FIRST else None)
        split = False
        if may_split:
            shape = self.splitting
            split = entries != plan_splits(host.tiles, entries, lens, seq_lens, self.block_q, shape.unit,
                                           shape.kv_heads, shape.num_sms, host.split_plan)
        self.i64[:uploaded].copy_(host.i64[:uploaded], non_blocking=True)
        # query starts, seq lens, the split plan and this bucket's programs
        head = self.tiles_at + count
        self.int32s[:head].copy_(host.i32[:head], non_blocking=True)
        self.block_tables[:num].copy_(host.block_tables[:num], non_blocking=True)
        host.mark_uploaded()
        fill_pending_tokens(self.token_rows(bucket)[0], work, query_start, prev_tokens)
        return self.i64[3 * bucket:uploaded], sampling, split


class PrefillGraphs:
    """Replays a captured forward pass for prefill and mixed steps of up to max_seqs sequences."""

    def __init__(self, model: nn.Module, config: EngineConfig, show_progress: bool = False) -> None:
        self.model = model
        self.block_size = config.block_size
        self.device = torch.device(config.device)
        self.sizes = prefill_token_buckets(config.max_num_batched_tokens)
        self.max_tokens = self.sizes[-1]
        self.max_seqs = min(config.max_num_seqs, MAX_GRAPH_SEQS)
        shape = split_shape(config)
        self.split_sizes = set(model_split_buckets(config))
        self.buffers = PrefillBuffers(self.max_tokens, -(-config.max_model_len // config.block_size), self.device,
                                      self.max_seqs, shape.block_q, config.max_model_len, config.block_size,
                                      splitting=shape if self.split_sizes else None)
        self.prompt_seqs = min(self.max_seqs, PROMPT_GRAPH_SEQS)
        # keyed by (bucket, prompts only, split)
        self.graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool, bool], torch.Tensor] = {}
        self._capture(show_progress)

    def graph_seqs(self, prompts_only: bool) -> int:
        """Sequences the prompts-only or the mixed graph of a bucket holds."""
        return self.prompt_seqs if prompts_only else self.max_seqs

    def _step(self, bucket: int, prompts_only: bool, split: bool) -> torch.Tensor:
        b = self.buffers
        ids, positions, _ = b.token_rows(bucket)
        return self.model(ids, positions, b.meta(bucket, self.graph_seqs(prompts_only), prompts_only, split))

    @torch.inference_mode()
    def _capture(self, show_progress: bool) -> None:
        pool = None
        with building_graphs():
            for bucket in tqdm(reversed(self.sizes), total=len(self.sizes), desc="Capturing prefill graphs",
                               disable=not show_progress):
                self.buffers.clear(bucket)
                splits = (False, True) if bucket in self.split_sizes else (False,)
                kinds = itertools.product((False, True), splits)   # (prompts only, split)
                for key in ((bucket, *kind) for kind in kinds):
                    self._step(*key)   # warm-up: compiles for this shape stay out of the graph
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self.outputs[key] = self._step(*key)
                    pool = graph.pool()
                    self.graphs[key] = graph
        torch.cuda.synchronize()

    def fits(self, work: list[SequenceWork]) -> bool:
        return fits_prefill_graph(work, self.max_tokens, self.max_seqs)

    def run(self, work: list[SequenceWork], prev_tokens: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, list[SequenceWork]]:
        """The sampling rows' last hidden states (gathered from the bucket's static output, in
        stream order before its next replay) and their sequences."""
        bucket = self.bucket(sum(w.num_new for w in work))
        prompts_only = len(work) <= self.prompt_seqs and all(w.num_new > 1 for w in work)
        rows, sampling, split = self.buffers.stage(work, bucket, self.graph_seqs(prompts_only), prev_tokens,
                                                   may_split=bucket in self.split_sizes)
        key = (bucket, prompts_only, split)
        self.graphs[key].replay()
        return self.outputs[key][rows], sampling

    def bucket(self, tokens: int) -> int:
        return next(s for s in self.sizes if s >= tokens)
