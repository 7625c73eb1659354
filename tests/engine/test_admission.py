"""Admission across front ends that share a core: each front end's admitted sequences in shared memory."""

from __future__ import annotations

import multiprocessing

import pytest

from nanoserve.engine.admission import Admission, QueueFullError, SharedCounts


def front_ends(count: int, max_num_seqs: int = 2, max_queue_len: int = 2) -> list[Admission]:
    slots = multiprocessing.get_context("spawn").Array("q", count, lock=False)
    return [Admission(max_num_seqs, max_queue_len, SharedCounts(slots, i)) for i in range(count)]


def test_front_ends_hold_the_capacity_together_not_each():
    a, b = front_ends(2)
    a.check(3, 0, "n")          # claimed at once, before a registers it
    with pytest.raises(QueueFullError):
        b.check(2, 0, "n")      # 3 + 2 > 4
    b.check(1, 0, "n")
    b.settle(1)
    with pytest.raises(QueueFullError):
        a.check(1, 3, "n")
    a.settle(3)
    a.settle(1)                 # two of a's finished
    b.check(2, 1, "n")
    assert a.shared.others() == 3 and b.shared.others() == 1


def test_a_refused_claim_is_given_back_and_a_single_front_end_shares_nothing():
    a, b = front_ends(2)
    b.settle(3)
    with pytest.raises(QueueFullError):
        a.check(2, 0, "prompt")
    assert b.shared.others() == 0   # a's claim went back
    alone = Admission(2, None, front_ends(1)[0].shared)   # no queue limit: nothing to count
    assert alone.shared is None
