"""The staged program list of a captured prefill step: which (sequence, query tile) programs the
prefill kernel runs, in which order, and how they pair up.

An entry is sequence << SEQ_SHIFT | slot << SLOT_SHIFT | tile (prefill_splits.py). The list runs
longest first, and the kernel launches a tile's kv heads side by side, so the waves after the first
hold the short programs: the last wave ends soon after the others instead of starting a long tile
late. A step of one wave gains nothing from order; there, pairing the i-th longest program with the
i-th shortest on tiles of half the rows evens the programs' lengths.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from nanoserve.runner.attention import prefill_splits

# a staged step lists its programs by the keys they read, most first, and launches a tile's kv heads
# side by side: a lone 2k-4k prompt's attention ran 20-37% faster on an H100, its TTFT 10-14% lower
# (BENCHMARKS.md); NANOSERVE_PREFILL_LONGEST_FIRST=0 restores sequence order, head by head
LONGEST_FIRST = os.environ.get("NANOSERVE_PREFILL_LONGEST_FIRST", "1") == "1"


def prefill_tiles(query_lens: Sequence[int], block_q: int, out: np.ndarray, seq_lens: np.ndarray | None = None,
                  pairs: bool = False) -> int:
    """Fill `out` (int32) with the (sequence, tile) programs of every sequence of more than one
    query (decode rows are paged_decode's), then -1; how many there are. Raises if they do not
    fit: `out` holds T / block_q + S entries for T tokens over S sequences. With `seq_lens` (each
    sequence's keys), the programs that read the most keys come first; with `pairs` too, as pairs
    of the i-th longest and the i-th shortest, for a kernel that runs two entries a program (an
    odd count's middle entry beside -1, so `out` holds one entry more)."""
    longest = max(query_lens, default=0)
    if len(query_lens) > 1 << (31 - prefill_splits.SEQ_SHIFT):
        raise ValueError(f"{len(query_lens)} sequences are more than a tiles entry holds")
    if -(-longest // block_q) > prefill_splits.TILE_FIELD + 1:
        raise ValueError(f"a query of {longest} tokens has more tiles than an entry holds")
    if len(query_lens) == 1:   # a lone prompt, the common graphed step: no vectorized fixed costs
        count = -(-longest // block_q) if longest > 1 else 0
        # sequence 0; a later tile reads more keys
        entries = np.arange(count - 1, -1, -1) if seq_lens is not None else np.arange(count)
    else:
        lens = np.asarray(query_lens, dtype=np.int64)
        per_seq = np.where(lens > 1, -(-lens // block_q), 0)
        count = int(per_seq.sum())
        seqs = np.repeat(np.arange(len(lens)), per_seq)
        tile = np.arange(count) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)   # 0, 1, ... within each sequence
        entries = (seqs << prefill_splits.SEQ_SHIFT) | tile
        if seq_lens is not None:
            entries = entries[np.argsort(-prefill_splits.keys_read(seqs, tile, lens, seq_lens, block_q), kind="stable")]
    if count + (pairs and count % 2) > out.shape[0]:
        raise ValueError(f"{count} prefill tiles do not fit in {out.shape[0]}")
    out[count:] = -1
    if pairs:
        half = -(-count // 2)
        out[0:2 * half:2] = entries[:half]
        out[1:2 * (count - half):2] = entries[::-1][:count - half]
    else:
        out[:count] = entries
    return count


# a captured step whose 64-row programs, run two a program, fill at most a wave runs them so (pairs_fit):
# NANOSERVE_PREFILL_PAIRS=1
PAIRS = os.environ.get("NANOSERVE_PREFILL_PAIRS", "0") == "1"


def pairs_fit(tokens: int, block_q: int, kv_heads: int, num_sms: int) -> bool:
    """Whether a step of `tokens` query tokens, in tiles of block_q run two a program, fills at most
    a wave (a program an SM): there, pairing a long tile with a short one halves the longest path."""
    return -(-tokens // block_q) * kv_heads <= 2 * num_sms


