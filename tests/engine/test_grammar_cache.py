"""The engine's cache of compiled grammars is bounded by their number and by the bytes they hold."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from nanoserve.engine.grammar_cache import CompileCache

MB = 1 << 20


def compiled(size: int) -> Future:
    future: Future = Future()
    future.set_result(SimpleNamespace(memory_size_bytes=size))
    return future


def test_the_least_recently_used_grammars_go_once_their_bytes_pass_the_budget():
    cache = CompileCache(max_entries=100, max_bytes=100 * MB)
    for key in "abc":
        cache.put((key,), compiled(40 * MB))
    assert cache.get(("a",)) is None and cache.get(("b",)) is not None and cache.bytes == 80 * MB
    assert cache.get(("b",)) is not None   # b is now the most recently used: c goes next
    cache.put(("d",), compiled(40 * MB))
    assert [cache.get((k,)) is not None for k in "bcd"] == [True, False, True] and len(cache) == 2


def test_a_grammar_counts_once_its_compile_is_done():
    cache = CompileCache(max_entries=100, max_bytes=100 * MB)
    pending: Future = Future()
    cache.put(("a",), pending)
    cache.put(("b",), compiled(60 * MB))
    assert len(cache) == 2 and cache.bytes == 60 * MB
    pending.set_result(SimpleNamespace(memory_size_bytes=60 * MB))
    assert cache.get(("b",)) is not None   # a, now known to be large and the least recently used, goes
    assert cache.get(("a",)) is None and cache.bytes == 60 * MB


def test_a_failed_compile_holds_no_bytes_and_the_newest_entry_stays_however_large():
    cache = CompileCache(max_entries=100, max_bytes=10 * MB)
    failed: Future = Future()
    failed.set_exception(ValueError("cannot compile"))
    cache.put(("bad",), failed)
    assert cache.bytes == 0 and len(cache) == 1
    cache.put(("huge",), compiled(50 * MB))   # its request's forks find it
    assert len(cache) == 1 and cache.get(("huge",)) is not None


def test_entries_past_the_count_go_first_in_first_out():
    cache = CompileCache(max_entries=3, max_bytes=1 << 40)
    for i in range(5):
        cache.put((i,), compiled(1))
    assert [cache.get((i,)) is not None for i in range(5)] == [False, False, True, True, True]


def test_a_spec_dropped_while_compiling_and_asked_again_is_counted_once():
    cache = CompileCache(max_entries=1, max_bytes=1 << 40)
    first: Future = Future()
    cache.put(("a",), first)
    cache.put(("b",), compiled(5))   # a is dropped while it compiles
    again = compiled(7)
    cache.put(("a",), again)         # and compiled again; b goes
    first.set_result(SimpleNamespace(memory_size_bytes=7))
    assert cache.get(("a",)) is again and cache.bytes == 7
