"""How paged decode divides contexts into splits, and the engine's choices of split size and
launch order. Functions of host values only, so a captured graph keeps what they chose."""

from __future__ import annotations

import functools
import os

import torch
import triton

# below this a split costs more in merging than it saves. Eagerly, batch 1 at 1k keys takes 12.4 us
# a layer in 16 splits of 64 keys against 17.7 in 4 of 256; yet in the decode graphs (PDL) the
# step was no faster with 64: 0.952 against 0.935 ms pipelined (BENCHMARKS.md, split counts)
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# programs per SM to aim for before splitting stops paying. 2 against 4 on an H200 (bf16, context 1k,
# pipelined ms): batch 32 2.315 -> 2.196 (2 splits, not 4), 48 2.913 -> 2.725 and 64 3.241 -> 3.093
# (1, not 2), 16 1.705 -> 1.629; 1 lost at 4-32 rows (BENCHMARKS.md, `gpu_suite.sh waves-ab`). An fp8
# cache keeps 4: its one-warp programs are many to an SM, and its workload's warm run fell from 36,160
# to 33,889 tok/s with 2 in the same call.
WAVES = 2
FP8_WAVES = 4


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4   # the interpreter: a small number keeps split counts (and CPU time) small
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_decode_splits(batch: int, kv_heads: int, max_seq_len: int, num_sms: int, fp8_cache: bool = False) -> int:
    """Splits per (sequence, kv head): enough programs to fill the GPU (WAVES an SM, FP8_WAVES over
    an fp8 cache), none shorter than MIN_TOKENS_PER_SPLIT. A function of host values only, so a
    captured graph keeps it.

    The count is rounded up to a power of two: on an H200, batch 16 x 8 kv heads at 8k context
    took 179 us with 5 splits (640 programs, a ragged last wave) and 142 us with 8."""
    waves = FP8_WAVES if fp8_cache else WAVES
    want = triton.next_power_of_2(-(-waves * num_sms // max(batch * kv_heads, 1)))
    by_len = -(-max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, by_len, MAX_SPLITS))


def split_span(split_keys: int | None, block_n: int) -> int:
    """Keys of each fixed-size split: split_keys rounded up to whole tiles; 0 for even splits."""
    return max(1, -(-split_keys // block_n)) * block_n if split_keys is not None else 0


def decode_split_count(batch: int, kv_heads: int, max_seq_len: int, device: torch.device, span: int = 0,
                       fp8_cache: bool = False) -> int:
    """The splits paged_decode launches: enough `span`-key splits to cover max_seq_len, or
    num_decode_splits' even division when span is 0."""
    if span:
        return min(MAX_SPLITS, max(1, -(-max_seq_len // span)))
    return num_decode_splits(batch, kv_heads, max_seq_len, num_sms(device), fp8_cache)


# An fp8 cache's one-warp programs all fit in about one wave, so over ragged contexts the longest
# ones set the kernel's end: splits of 512 keys, launched longest first, took the 256-sequence
# workload from 27,571 to 30,379 tok/s on an H200 (BENCHMARKS.md). A bf16 cache lost ~1% with them.
# Once each tile's block is read ahead (two stages), 1,024 keys do better: 33,876 -> 35,313 warm.
FP8_SPLIT_KEYS = 1024


@functools.lru_cache(maxsize=None)
def _split_keys_asked() -> int | None:
    value = os.environ.get("NANOSERVE_DECODE_SPLIT_KEYS")   # read once: attention asks every layer
    return int(value) if value else None


def engine_split_keys(batch: int, kv_heads: int, max_seq_len: int, device: torch.device,
                      fp8_cache: bool = False) -> int | None:
    """paged_decode's split_keys for the engine at batches that fill the GPU with one split per
    (sequence, kv head), where a ragged batch's longest contexts still set the kernel's end:
    FP8_SPLIT_KEYS over an fp8 cache, NANOSERVE_DECODE_SPLIT_KEYS=n to choose (0: even splits);
    None (even splits) elsewhere."""
    keys = _split_keys_asked()
    if keys is None:
        keys = FP8_SPLIT_KEYS if fp8_cache else 0
    if not keys or num_decode_splits(batch, kv_heads, max_seq_len, num_sms(device), fp8_cache) > 1:
        return None
    return keys


def longest_first_enabled(fp8_cache: bool) -> bool:
    """Whether decode graphs launch each step's rows longest first (see paged_decode's seq_order):
    over an fp8 cache, unless NANOSERVE_LONGEST_FIRST says otherwise (1 on, 0 off)."""
    asked = os.environ.get("NANOSERVE_LONGEST_FIRST")
    return fp8_cache if asked is None else asked == "1"


def longest_first(seq_lens: torch.Tensor) -> torch.Tensor:
    """The rows by falling length, for paged_decode's seq_order, on the device (the decode graphs
    stage theirs from the host instead, beside the lengths)."""
    return torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
