"""The startup's eager mixed steps: each is a step the Triton backend splits between its prefill and
decode kernels, at the decode split count it was chosen for, within the step's token budget."""

from __future__ import annotations

import pytest
import torch

import nanoserve.runner.attention.triton_decode as triton_decode
import nanoserve.runner.attention.triton_kernels as triton_kernels
from nanoserve.runner.attention.triton_kernels import MIXED_MIN_DECODE_ROWS, mixed_step_shapes
from nanoserve.runner.inputs import build_inputs
from nanoserve.runner.warm_up import mixed_warm_up_work

CPU = torch.device("cpu")


@pytest.fixture
def h200_sms(monkeypatch):
    monkeypatch.setattr(triton_kernels, "num_sms", lambda device: 132)


def test_every_merge_width_of_a_mixed_step_is_warmed_once(h200_sms) -> None:
    shapes = mixed_step_shapes(512, 16384, 4096, 8, CPU)
    widths = [triton_decode.num_decode_splits(seqs, 8, longest, 132) for seqs, longest in shapes]
    reachable = {triton_decode.num_decode_splits(seqs, 8, longest, 132)
                 for seqs in range(MIXED_MIN_DECODE_ROWS + 1, 513) for longest in range(1, 4097, 97)}
    assert sorted(widths) == sorted({1 << (w - 1).bit_length() for w in reachable}) == [1, 2]


@pytest.mark.parametrize("seqs,longest", [(33, 256), (33, 512), (40, 1000)])
def test_a_warm_up_step_is_a_mixed_step_of_its_shape(seqs, longest) -> None:
    work = mixed_warm_up_work(seqs, longest, block_size=16, num_blocks=64)
    meta = build_inputs(work, 16, CPU).meta
    assert len(work) == seqs and meta.max_seq_len == longest and meta.max_query_len == 2
    assert meta.num_decode_rows == seqs - 1 >= MIXED_MIN_DECODE_ROWS
    assert all(w.params is None for w in work), "nothing samples"


def test_no_warm_up_step_exceeds_the_token_budget_or_the_cache(h200_sms) -> None:
    assert mixed_step_shapes(512, MIXED_MIN_DECODE_ROWS + 1, 4096, 8, CPU) == []
    assert all(seqs + 1 <= 100 for seqs, _ in mixed_step_shapes(512, 100, 4096, 8, CPU))
    assert mixed_warm_up_work(33, 4096, block_size=256, num_blocks=15) is None
