"""The startup's eager steps: mixed ones the Triton backend splits between its prefill and decode
kernels, and decode-only ones, each at the decode split count it was chosen for, covering every
merge width such steps can reach, within the step's token budget and the cache."""

from __future__ import annotations

import pytest
import torch

import nanoserve.runner.attention.decode_splits as decode_splits
from nanoserve.runner.attention.decode_splits import decode_split_count, engine_split_keys, split_span
from nanoserve.runner.attention.decode_tiles import decode_config
from nanoserve.runner.attention.triton_kernels import DECODE_ROPE_MAX_ROWS, MIXED_MIN_DECODE_ROWS, eager_step_shapes
from nanoserve.runner.inputs import build_inputs
from nanoserve.runner.warm_up import warm_up_work

CPU = torch.device("cpu")


@pytest.fixture
def h200_sms(monkeypatch):
    monkeypatch.setattr(decode_splits, "num_sms", lambda device: 132)


def widths(mixed: bool, seqs: int, length: int, fp8: bool) -> tuple[int, bool]:
    """The merge width paged_decode launches for this step (8 kv heads, a program each), and
    whether its decode kernel norms, rotates and stores the new key itself (a lone decode row)."""
    block_n = decode_config(CPU, fp8, torch.bfloat16, 128)["BLOCK_N"]
    keys = None if mixed else engine_split_keys(seqs, 8, length, CPU, fp8)
    splits = decode_split_count(seqs, 8, length, CPU, split_span(keys, block_n), fp8)
    return 1 << (splits - 1).bit_length(), not mixed and seqs <= DECODE_ROPE_MAX_ROWS


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "decode-only"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_every_merge_width_an_eager_step_reaches_is_warmed_once(h200_sms, mixed, fp8) -> None:
    """Each merge width once, and under decode alone once more with the rope inside the decode
    kernel (the kernels differ: a server under enforce_eager compiled the other one mid-stream)."""
    shapes = eager_step_shapes(mixed, 512, 16384, 4096, 8, 128, torch.bfloat16, CPU, fp8)
    warmed = [widths(mixed, seqs, longest, fp8) for seqs, longest in shapes]
    first = MIXED_MIN_DECODE_ROWS + 1 if mixed else 1
    reachable = {widths(mixed, seqs, length, fp8) for seqs in range(first, 513) for length in range(1, 4097, 37)}
    assert sorted(warmed) == sorted(reachable)
    # over a bf16 cache a mixed step's 33 or more decode rows fill 132 SMs unsplit (decode_splits.WAVES)
    assert len({width for width, _ in reachable}) == 1 if mixed and not fp8 else len({width for width, _ in reachable}) > 1
    assert {rope for _, rope in reachable} == ({False} if mixed else {False, True})


@pytest.mark.parametrize("seqs,longest,with_prompt", [(33, 256, True), (40, 1000, True), (1, 300, False),
                                                       (5, 64, False)])
def test_a_warm_up_step_has_its_shape(seqs, longest, with_prompt) -> None:
    work = warm_up_work(seqs, longest, block_size=16, num_blocks=64, with_prompt=with_prompt)
    meta = build_inputs(work, 16, CPU).meta
    assert len(work) == seqs and meta.max_seq_len == longest
    assert meta.max_query_len == (2 if with_prompt else 1)
    assert meta.num_decode_rows == seqs - with_prompt
    assert all(w.params is None for w in work), "nothing samples"


def test_no_warm_up_step_exceeds_the_token_budget_or_the_cache(h200_sms) -> None:
    def shapes(mixed: bool, budget: int, fp8: bool) -> list[tuple[int, int]]:
        return eager_step_shapes(mixed, 512, budget, 4096, 8, 128, torch.bfloat16, CPU, fp8)

    assert shapes(True, MIXED_MIN_DECODE_ROWS + 1, False) == []
    assert all(seqs + 1 <= 100 for seqs, _ in shapes(True, 100, False))
    assert all(seqs <= 20 for seqs, _ in shapes(False, 20, True))
    assert warm_up_work(33, 4096, block_size=256, num_blocks=15) is None
