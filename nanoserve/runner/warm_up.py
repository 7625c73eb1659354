"""Eager steps run once at startup, before any request, so that the kernels they launch compile
then and not under the first step served that needs them (a Triton compile takes about a second,
and every running request waits for it)."""

from __future__ import annotations

from nanoserve.runner.batch import SequenceWork


def warm_up_work(seqs: int, longest: int, block_size: int, num_blocks: int,
                 with_prompt: bool = True) -> list[SequenceWork] | None:
    """A step of `seqs` sequences: decode rows, the first of them `longest` keys long, and (a mixed
    step) a 2-token prompt last; None when the cache cannot hold that row. Nothing samples, and what
    it writes to the cache is overwritten before any request reads it: no block belongs to one yet."""
    blocks = -(-longest // block_size)
    if seqs < 1 + with_prompt or blocks > num_blocks:
        return None
    long_row = SequenceWork([0] * longest, longest, longest - 1, 1, list(range(blocks)), None)
    short_rows = [SequenceWork([0], 1, 0, 1, [0], None) for _ in range(seqs - 1 - with_prompt)]
    prompt = [SequenceWork([0, 0], 2, 0, 2, [0], None)] if with_prompt else []
    return [long_row, *short_rows, *prompt]
