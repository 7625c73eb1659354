"""Grammars in use are bounded: a request whose grammar does not fit the budget waits, first come
first served, and every way out of the engine gives its share back."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from nanoserve.engine.grammar_queue import GrammarBudget, GrammarQueue
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured_outputs_params import StructuredOutputsParams

MB = 1 << 20


class FakeCompiler:
    """Compiles `regex` specs named "<name>:<MB>" to a grammar of that many MB; counts its compiles.
    With `manual`, compiles finish only when `finish` says so."""

    def __init__(self, manual: bool = False) -> None:
        self.manual, self.calls, self.pending = manual, [], {}

    def __call__(self, spec: StructuredOutputsParams) -> Future:
        self.calls.append(spec.regex)
        future: Future = Future()
        if self.manual:
            self.pending[spec.regex] = future
        else:
            self._done(spec.regex, future)
        return future

    def finish(self, regex: str) -> None:
        self._done(regex, self.pending.pop(regex))

    @staticmethod
    def _done(regex: str, future: Future) -> None:
        if regex.startswith("bad"):
            future.set_exception(ValueError("The regex given for structured outputs cannot be compiled"))
        else:
            future.set_result(SimpleNamespace(memory_size_bytes=int(regex.split(":")[1]) * MB, name=regex))


def seq(regex: str) -> Sequence:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex))
    return Sequence(regex, [1, 2, 3], params)


def names(ready) -> list[str]:
    return [s.request_id for s, _ in ready]


def test_a_grammar_that_does_not_fit_waits_until_a_holder_leaves():
    queue = GrammarQueue(FakeCompiler(), max_bytes=100 * MB)
    a, b, c = seq("a:60"), seq("b:30"), seq("c:40")
    for s in (a, b, c):
        queue.add(s)
    ready, failed = queue.admit()
    assert names(ready) == ["a:60", "b:30"] and not failed and len(queue) == 1
    assert queue.budget.bytes == 90 * MB
    assert queue.admit() == ([], [])            # still no room for c
    queue.release(a)
    assert names(queue.admit()[0]) == ["c:40"] and queue.budget.bytes == 70 * MB
    queue.release(b), queue.release(c)
    assert queue.budget.bytes == 0 and len(queue.budget) == 0 and queue.budget.peak == 90 * MB


def test_requests_behind_one_waiting_for_room_wait_too_first_come_first_served():
    queue = GrammarQueue(FakeCompiler(), max_bytes=100 * MB)
    big, small = seq("big:80"), seq("small:1")
    running = seq("run:50")
    queue.add(running)
    queue.admit()
    queue.add(big)
    queue.add(small)   # it would fit, but a stream of small ones would then starve the big one
    assert queue.admit() == ([], []) and len(queue) == 2
    queue.release(running)
    assert names(queue.admit()[0]) == ["big:80", "small:1"]


def test_a_grammar_larger_than_the_budget_runs_alone():
    queue = GrammarQueue(FakeCompiler(), max_bytes=10 * MB)
    first, huge = seq("first:5"), seq("huge:50")
    queue.add(first)
    queue.add(huge)
    assert names(queue.admit()[0]) == ["first:5"]
    assert queue.admit() == ([], [])
    queue.release(first)
    assert names(queue.admit()[0]) == ["huge:50"] and queue.budget.bytes == 50 * MB


def test_sequences_of_one_spec_share_its_bytes_and_a_fork_starts_at_no_cost():
    compiler = FakeCompiler()
    queue = GrammarQueue(compiler, max_bytes=100 * MB)
    parent, twin = seq("g:60"), seq("g:60")
    queue.add(parent)
    queue.add(twin)
    assert names(queue.admit()[0]) == ["g:60", "g:60"] and queue.budget.bytes == 60 * MB
    waiting = seq("other:50")
    queue.add(waiting)
    assert queue.admit() == ([], [])
    fork = seq("g:60")
    assert queue.share(fork).name == "g:60"      # ahead of the request waiting for room
    assert queue.share(seq("never:1")) is None    # nothing holds that spec
    for s in (parent, twin):
        queue.release(s)
    assert queue.budget.bytes == 60 * MB and queue.admit() == ([], [])   # the fork still holds it
    queue.release(fork)
    assert names(queue.admit()[0]) == ["other:50"]
    assert compiler.calls == ["g:60", "other:50"]   # the twin found the grammar its elder holds


def test_a_spec_held_by_a_running_sequence_is_not_compiled_again():
    compiler = FakeCompiler()
    queue = GrammarQueue(compiler, max_bytes=100 * MB)
    first = seq("g:10")
    queue.add(first)
    queue.admit()
    again = seq("g:10")
    queue.add(again)
    (_, compiled), = queue.admit()[0]
    assert compiler.calls == ["g:10"] and compiled.name == "g:10" and queue.budget.bytes == 10 * MB


def test_compiles_start_in_order_at_most_two_at_a_time_and_none_behind_a_request_waiting_for_room():
    compiler = FakeCompiler(manual=True)
    queue = GrammarQueue(compiler, max_bytes=100 * MB, max_compiling=2)
    for name in ("a:90", "b:20", "c:1", "d:1"):
        queue.add(seq(name))
    assert queue.admit() == ([], []) and compiler.calls == ["a:90", "b:20"]
    compiler.finish("b:20")
    assert names(queue.admit()[0]) == ["b:20"] and compiler.calls == ["a:90", "b:20", "c:1"]
    compiler.finish("a:90")   # does not fit beside b: c may finish compiling, but d does not start
    assert queue.admit() == ([], []) and compiler.calls == ["a:90", "b:20", "c:1"]
    compiler.finish("c:1")
    assert queue.admit() == ([], []) and compiler.calls == ["a:90", "b:20", "c:1"]


def test_a_failed_compile_fails_its_request_alone_and_an_aborted_one_leaves_nothing():
    queue = GrammarQueue(FakeCompiler(), max_bytes=100 * MB)
    bad, good, gone = seq("bad:1"), seq("good:1"), seq("gone:1")
    for s in (bad, good, gone):
        queue.add(s)
    assert queue.remove(gone) and not queue.remove(gone)
    ready, failed = queue.admit()
    assert names(ready) == ["good:1"] and [(s.request_id, "cannot be compiled" in why) for s, why in failed] == [
        ("bad:1", True)]
    queue.release(bad), queue.release(gone)   # held nothing: nothing to give back
    queue.release(good), queue.release(good)  # given back once only
    assert queue.budget.bytes == 0 and len(queue) == 0


def test_the_budget_counts_each_key_once_from_first_acquire_to_last_release():
    budget = GrammarBudget(max_bytes=10 * MB)
    future: Future = Future()
    future.set_result(SimpleNamespace(memory_size_bytes=8 * MB))
    assert budget.fits(("k",), 8 * MB) and budget.acquire(("k",), future) is future
    assert budget.fits(("k",), 8 * MB) and not budget.fits(("j",), 8 * MB)
    other: Future = Future()
    other.set_result(SimpleNamespace(memory_size_bytes=8 * MB))
    assert budget.acquire(("k",), other) is future   # a second compile of the key is not held
    budget.release(("k",))
    assert budget.bytes == 8 * MB
    budget.release(("k",))
    assert budget.bytes == 0 and budget.fits(("j",), 80 * MB)
