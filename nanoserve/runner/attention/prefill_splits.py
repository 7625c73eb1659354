"""Key splits for the prefill programs of a captured step too small to fill the GPU.

A step's programs are (query tile, kv head) pairs, and each reads every key up to its tile's last
query. A chunk after a long history (a conversation's next turn found in the prefix cache, a
chunked prompt's last part) is a few programs that each read all of that history: 64 new tokens
after 4,096 cached ones are 8 programs over 4,160 keys on 132 SMs. Where a step's programs are
fewer than the SMs and a split is estimated to finish sooner (split_span), the host cuts its long
tiles' keys into ranges; every part writes its unnormalized output and softmax statistics to a
scratch slot, and `merge_parts` folds a tile's parts into its rows, as decode's split merge does.
A lone fresh prompt is not split: its tiles' keys already fill about one wave.

In the program list (prefill_tiles) an entry is sequence << SEQ_SHIFT | slot << SLOT_SHIFT |
query tile, where slot 0 is a whole tile and slot s > 0 a part whose key range is ranges[s - 1]. A
merge entry is (sequence << SEQ_SHIFT | query tile, first slot, parts), -1 where unused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from nanoserve.runner.pdl import pdl_launch, pdl_prologue

SEQ_SHIFT = 21             # an entry's sequence (up to 1,024: MAX_GRAPH_SEQS is 512); below it the slot, then the tile
SLOT_SHIFT = 15            # an entry's tile field holds 32,768 tiles: 8,192 tokens of BLOCK_Q >= 1
TILE_FIELD = (1 << SLOT_SHIFT) - 1
SLOT_FIELD = (1 << (SEQ_SHIFT - SLOT_SHIFT)) - 1
MAX_SLOTS = 48             # parts a step may write (< SLOT_FIELD); each slot is a tile of fp32 rows a kv head
MAX_MERGES = 24            # split tiles a step may have


def split_unit(device: torch.device) -> int:
    """Keys of the smallest part, a multiple of every prefill BLOCK_N on the device: 256 on a GPU
    (two 128-key tiles: a part shorter than that pays its query load and merge for little); 32
    under the interpreter, where tiles are 16 keys."""
    return 256 if device.type == "cuda" else 32


@dataclass
class PrefillSplits:
    """A captured step's split plan on the device and the parts' scratch."""

    merges: torch.Tensor    # [MAX_MERGES, 3] int32
    ranges: torch.Tensor    # [MAX_SLOTS, 2] int32: each part's first key and end
    acc: torch.Tensor       # [MAX_SLOTS, kv_heads, BLOCK_M, head_dim] float32
    stats: torch.Tensor     # [MAX_SLOTS, kv_heads, 2, BLOCK_M] float32: running max (base 2) and sum

    @staticmethod
    def scratch_bytes(kv_heads: int, block_m: int, head_dim: int) -> int:
        return MAX_SLOTS * kv_heads * block_m * (head_dim + 2) * 4

    @staticmethod
    def allocate(int32_region: torch.Tensor, kv_heads: int, block_m: int, head_dim: int) -> "PrefillSplits":
        """Views of `int32_region` (PLAN_SIZE values) and fresh scratch."""
        device = int32_region.device
        merges, ranges = plan_views(int32_region)
        return PrefillSplits(
            merges=merges, ranges=ranges,
            acc=torch.empty(MAX_SLOTS, kv_heads, block_m, head_dim, dtype=torch.float32, device=device),
            stats=torch.empty(MAX_SLOTS, kv_heads, 2, block_m, dtype=torch.float32, device=device))


@dataclass(frozen=True)
class SplitShape:
    """What a captured step's split plan and scratch are sized by."""

    unit: int         # split_unit
    kv_heads: int
    num_sms: int
    block_m: int      # the prefill tiles' rows and query tokens (prefill_tile_rows)
    block_q: int
    head_dim: int

    def list_room(self) -> int:
        """Program-list entries a split step may need: fewer than num_sms / kv_heads before, and
        at most MAX_SLOTS more after."""
        return (self.num_sms - 1) // self.kv_heads + MAX_SLOTS

    def may_split(self, tokens: int) -> bool:
        """Whether a step of one prompt of `tokens` has fewer programs than SMs: a bucket whose
        smallest step is that size may be split."""
        return -(-tokens // self.block_q) * self.kv_heads < self.num_sms


PLAN_SIZE = MAX_MERGES * 3 + MAX_SLOTS * 2   # int32 values of a split plan, staged with the program list


def plan_views(region):
    """The merges [MAX_MERGES, 3] and part ranges [MAX_SLOTS, 2] of a plan's int32 `region` (numpy
    or torch), as views."""
    return region[:MAX_MERGES * 3].reshape(MAX_MERGES, 3), region[MAX_MERGES * 3:].reshape(MAX_SLOTS, 2)


def keys_read(seqs: np.ndarray, tiles: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray,
              block_q: int) -> np.ndarray:
    """The keys each program (sequence `seqs[i]`, query tile `tiles[i]`) reads: its sequence's
    history, then its queries up to the tile's last."""
    lens = query_lens[seqs]
    return seq_lens[seqs].astype(np.int64) - lens + np.minimum((tiles + 1) * block_q, lens)


def split_span(ends: np.ndarray, unit: int, kv_heads: int, num_sms: int) -> int:
    """The part length (whole units) that a step of one-wave programs ending at `ends` keys is
    estimated to finish soonest with, or 0 where no split beats the whole tiles.

    A wave of programs lasts about as long as its longest part plus a program's fixed cost (its
    query load, softmax tail and stores), taken as a unit of keys; the merge costs two units. Measured
    on an H100 (BENCHMARKS.md): splitting a lone 512- or 1k-token prompt into two-unit parts lost
    0.1-0.8 ms, where a second wave of programs and the merge cost more than the longest tile's
    keys saved; 64 tokens after 4,096 cached ones took 3.7-4.0 ms split against 5.9-6.5 whole."""
    longest = int(ends.max())
    # waves x span >= the keys an SM must read, so no estimate beats the whole tiles unless that
    # share plus the fixed costs is below the longest tile (a lone fresh prompt never is)
    if int(ends.sum()) * kv_heads / num_sms + 2 * unit >= longest:
        return 0
    return best_span(ends, unit, kv_heads, num_sms)


def best_span(ends: np.ndarray, unit: int, kv_heads: int, num_sms: int) -> int:
    """split_span's estimate over every span, without its shortcut."""
    longest = int(ends.max())
    spans = unit * np.arange(1, -(-longest // unit), dtype=np.int64)
    if not len(spans):
        return 0
    parts = -(-ends[None, :] // spans[:, None])                    # [span, tile]
    waves = -(-parts.sum(axis=1) * kv_heads // num_sms)
    estimate = waves * (spans + unit) + 2 * unit
    split = parts > 1
    fits = ((parts * split).sum(axis=1) <= MAX_SLOTS) & (split.sum(axis=1) <= MAX_MERGES)
    estimate = np.where(fits, estimate, np.iinfo(np.int64).max)
    best = int(np.argmin(estimate))
    return int(spans[best]) if estimate[best] < longest + unit else 0


def plan_splits(tiles: np.ndarray, count: int, query_lens: list[int], seq_lens: np.ndarray, block_q: int,
                unit: int, kv_heads: int, num_sms: int, region: np.ndarray) -> int:
    """Where the step's programs (`tiles[:count]`, prefill_tiles' entries, times kv_heads) are fewer
    than the SMs and a split is estimated to pay (split_span), cut its long tiles into key ranges
    of that span. Writes the plan into `region` (PLAN_SIZE values) and the new list into
    `tiles`, longest programs first; returns its length, at most count + MAX_SLOTS (`tiles` must
    hold that many)."""
    merges, ranges = plan_views(region)
    merges[:] = -1
    if count == 0 or count * kv_heads >= num_sms:
        return count
    entries = tiles[:count].astype(np.int64)
    ends = keys_read(entries >> SEQ_SHIFT, entries & TILE_FIELD, np.asarray(query_lens, dtype=np.int64), seq_lens,
                     block_q)
    span = split_span(ends, unit, kv_heads, num_sms)
    if not span:
        return count
    programs: list[tuple[int, int]] = []   # (keys, entry)
    slot = merge = 0
    for end, entry in zip(ends.tolist(), entries.tolist()):
        parts = -(-end // span)
        if parts < 2:
            programs.append((end, entry))
            continue
        merges[merge] = (entry, slot + 1, parts)
        merge += 1
        for p in range(parts):
            first = p * span
            ranges[slot + p] = (first, min(first + span, end))
            programs.append((min(span, end - first), entry | (slot + p + 1) << SLOT_SHIFT))
        slot += parts
    programs.sort(key=lambda program: -program[0])
    tiles[:len(programs)] = [entry for _, entry in programs]
    return len(programs)


_SEQ_SHIFT = tl.constexpr(SEQ_SHIFT)
_SLOT_SHIFT = tl.constexpr(SLOT_SHIFT)
_TILE_FIELD = tl.constexpr(TILE_FIELD)
_SLOT_FIELD = tl.constexpr(SLOT_FIELD)


@triton.jit
def unpack_entry(packed):
    """(sequence, slot, query tile) of a program or merge entry; a merge entry's slot is 0."""
    return packed >> _SEQ_SHIFT, (packed >> _SLOT_SHIFT) & _SLOT_FIELD, packed & _TILE_FIELD


@triton.jit
def _merge_kernel(merges_ptr, query_start_loc_ptr, acc_ptr, stats_ptr, out_ptr, v_scale,
                  stride_qsl, stride_ot, stride_oh,
                  GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                  KV_FP8: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    merge = tl.program_id(0)
    kv_head = tl.program_id(1)
    kv_heads = tl.num_programs(1)
    packed = tl.load(merges_ptr + merge * 3)
    if packed < 0:
        return
    first = tl.load(merges_ptr + merge * 3 + 1)
    parts = tl.load(merges_ptr + merge * 3 + 2)
    seq, _, q_tile = unpack_entry(packed)
    q_start = tl.load(query_start_loc_ptr + seq * stride_qsl)
    q_len = tl.load(query_start_loc_ptr + (seq + 1) * stride_qsl) - q_start

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = q_tile * BLOCK_Q + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    mask_m = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for p in range(parts):
        at = ((first - 1 + p) * kv_heads + kv_head).to(tl.int64)
        m_p = tl.load(stats_ptr + at * 2 * BLOCK_M + offs_m)
        l_p = tl.load(stats_ptr + at * 2 * BLOCK_M + BLOCK_M + offs_m)
        acc_p = tl.load(acc_ptr + at * BLOCK_M * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
        m_new = tl.maximum(m, m_p)
        old, new = tl.exp2(m - m_new), tl.exp2(m_p - m_new)
        l = l * old + l_p * new
        acc = acc * old[:, None] + acc_p * new[:, None]
        m = m_new
    o = acc / l[:, None]
    if KV_FP8:
        o = o * v_scale
    q_rows = (q_start + tok).to(tl.int64)
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def merge_parts(splits: PrefillSplits, query_start_loc: torch.Tensor, out: torch.Tensor, group: int, block_q: int,
                block_m: int, fp8: bool, v_scale: float) -> None:
    """Write each split tile's rows of `out` from its parts (launched after the prefill kernel)."""
    kv_heads, head_dim = splits.acc.shape[1], splits.acc.shape[3]
    _merge_kernel[(MAX_MERGES, kv_heads)](
        splits.merges, query_start_loc, splits.acc, splits.stats, out, v_scale,
        query_start_loc.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, KV_FP8=fp8,
        num_warps=8, **pdl_launch(out.device))
