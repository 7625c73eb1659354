"""The priority policy (vLLM's --scheduling-policy priority), driven without a model: the test plays
the engine, as in test_scheduler.py."""

from __future__ import annotations

from nanoserve.engine.sequence import SequenceStatus
from tests.engine.test_scheduler import FakeEngine


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def test_priority_policy_admits_the_lower_priority_value_first_then_the_earlier_arrival():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    for name, priority in (("a", 5), ("b", 0), ("c", 5), ("d", -3), ("e", 0)):
        eng.add(name, [1, 2, 3], max_tokens=2, priority=priority)
    assert ids(eng.sched.waiting) == ["d", "b", "e", "a", "c"]
    eng.run()
    assert eng.finish_order == ["d", "b", "e", "a", "c"]


def test_first_come_first_served_ignores_priorities():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    for name, priority in (("a", 5), ("b", 0), ("c", -3)):
        eng.add(name, [1, 2, 3], max_tokens=2, priority=priority)
    eng.run()
    assert eng.finish_order == ["a", "b", "c"]


def test_a_waiting_request_of_higher_priority_preempts_the_last_running_one_when_seats_are_full():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, policy="priority")
    low = eng.add("low", [1, 2, 3], max_tokens=20, priority=1)
    mid = eng.add("mid", [4, 5, 6], max_tokens=20, priority=0)
    eng.step()
    urgent = eng.add("urgent", [7, 8, 9], max_tokens=2, priority=-1)
    step = eng.step()
    # low was scheduled for its decode, then gave its seat (and its step's token) to urgent
    assert step.seqs == [mid, urgent] and step.num_new_tokens == [1, 3]
    assert step.num_preempted == 1
    assert low.status == SequenceStatus.WAITING and low.block_table == [] and low.num_preemptions == 1
    assert ids(eng.sched.running) == ["urgent", "mid"]
    eng.run()
    assert eng.finish_order == ["urgent", "mid", "low"]
    assert low.num_output_tokens == 20 and eng.bm.num_free_blocks == 64


def test_an_equal_priority_never_preempts_for_admission():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    first = eng.add("first", [1, 2, 3], max_tokens=5, priority=2)
    eng.step()
    eng.add("second", [4, 5, 6], max_tokens=5, priority=2)
    for _ in range(3):
        assert eng.step().seqs == [first]
    eng.run()
    assert eng.finish_order == ["first", "second"] and first.num_preemptions == 0


def test_a_waiting_request_of_higher_priority_takes_the_blocks_of_lower_ones():
    # 6 blocks of 4: two running requests of 2 blocks each, then one that needs 3
    eng = FakeEngine(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, policy="priority")
    a = eng.add("a", [1] * 7, max_tokens=9, priority=3)
    b = eng.add("b", [2] * 7, max_tokens=9, priority=4)
    eng.step()
    assert eng.bm.num_free_blocks == 2
    urgent = eng.add("urgent", [3] * 10, max_tokens=2, priority=0)
    step = eng.step()
    assert urgent in step.seqs and b not in step.seqs
    assert b.status == SequenceStatus.WAITING and b.num_preemptions == 1 and a.num_preemptions == 0
    eng.run()
    assert eng.finish_order[0] == "urgent"
    assert all(s.num_output_tokens == s.max_tokens for s in (a, b, urgent))
    assert eng.bm.num_free_blocks == 6


def test_when_blocks_run_out_the_last_in_priority_is_preempted_not_the_newest():
    eng = FakeEngine(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, policy="priority")
    old_low = eng.add("old_low", [1, 1, 1, 1], max_tokens=3, priority=9)   # 1 block, needs a 2nd
    new_high = eng.add("new_high", [2, 2, 2, 2, 2], max_tokens=3, priority=0)   # 2 blocks
    mid = eng.add("mid", [3, 3, 3], max_tokens=3, priority=1)   # 1 block: the cache is now full
    eng.step()
    step = eng.step()
    assert step.num_preempted == 1 and old_low.num_preemptions == 1
    assert step.seqs == [new_high, mid]
    eng.run()
    assert eng.finish_order == ["new_high", "mid", "old_low"]
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def test_a_preempted_request_whose_last_token_is_still_being_sampled_waits_for_it():
    # pipelined steps: a sequence preempted while its step is in flight holds a placeholder at its
    # end until that step is read back, and may not be computed before
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, policy="priority")
    waiting = eng.add("waiting", [1] * 6, max_tokens=4)
    waiting.pending_row = 0   # as the engine marks a row whose sampled id is not read back yet
    assert eng.sched.schedule().seqs == []
    waiting.pending_row = -1   # read back
    assert eng.sched.schedule().seqs == [waiting]


def test_a_running_request_with_a_token_being_sampled_runs_only_as_its_decode(caplog):
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    seq = eng.add("seq", [1] * 6, max_tokens=8)
    eng.step()
    seq.pending_row = 0   # its last token is the one being sampled: a decode of it may run
    assert eng.sched.schedule().seqs == [seq] and seq.num_computed_tokens == seq.num_tokens - 1
    seq.num_computed_tokens = 2   # with more to compute before it, the runner would read it in the wrong row
    with caplog.at_level("ERROR"):
        assert eng.sched.schedule().seqs == []
    assert "holds a token still being sampled behind 5 uncomputed tokens" in caplog.text
