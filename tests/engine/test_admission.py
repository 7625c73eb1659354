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


def test_retry_after_reads_the_rate_over_the_time_completions_were_seen(monkeypatch):
    """Ten completions in the last 2 s drain 10 queued sequences in about 2 s, not 30 s."""
    from nanoserve.engine import admission as module

    now = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    gate = Admission(1, 1)
    for i in range(10):
        now[0] = 1000.0 + 0.2 * i
        gate.finished()
    now[0] = 1002.0
    assert all(gate._retry_after(10) <= 3 for _ in range(20))
    assert 4 <= Admission(1, 1)._retry_after(10) <= 6   # none seen yet: 5 s, jittered
