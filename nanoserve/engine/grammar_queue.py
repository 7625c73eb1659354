"""Requests waiting for their grammar: to compile, then for room in the budget of grammars in use.

The compile cache (grammar_cache.py) bounds what the engine keeps for reuse; this bounds what
its sequences hold. A matcher keeps its compiled grammar alive, so each running or queued
structured-output request held one (~27 MB for a 115 KiB regex) for as long as it lived:
20 distinct such specs took the engine from 346 to 979 MB, and the default admission
(256 running + 1,024 waiting) allowed ~40 GB. Grammars are counted by xgrammar's own figure of
their size, once per spec however many sequences share it (n choices, equal specs).

A request whose grammar does not fit waits here, holding no KV block; requests behind it that
need a grammar wait too (first come, first served: a stream of small grammars cannot starve a
large one), while requests without a grammar never come here. One grammar larger than the whole
budget runs once nothing else holds any. Compiles start in arrival order, at most
`max_compiling` at a time and none behind a request waiting for room, so a flood of distinct
specs leaves at most that many compiled grammars waiting beside the budget.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from nanoserve.defaults import MAX_GRAMMAR_BYTES
from nanoserve.engine.sequence import Sequence



class GrammarBudget:
    """Bytes of compiled grammars held by the engine's sequences, by spec key: each counts once,
    from its first holder's `acquire` to its last holder's `release`."""

    def __init__(self, max_bytes: int = MAX_GRAMMAR_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.peak = 0   # the most `bytes` ever was (for tests and stats)
        self._held: dict[tuple, tuple[Future, int]] = {}   # key -> (its compile, its bytes)
        self._holders: dict[tuple, int] = {}

    def __len__(self) -> int:
        return len(self._held)

    def held(self, key: tuple) -> Future | None:
        """The compile in use under this key, if any sequence holds one."""
        entry = self._held.get(key)
        return entry[0] if entry else None

    def fits(self, key: tuple, size: int) -> bool:
        # alone: a grammar larger than the budget still runs, once nothing else holds any
        return key in self._held or self.bytes + size <= self.max_bytes or not self._held

    def acquire(self, key: tuple, future: Future) -> Future:
        """Hold the key's grammar; returns the compile in use, which is an earlier holder's where
        there is one (a spec compiled twice, once dropped from the cache, is then held once)."""
        if key in self._held:
            self._holders[key] += 1
            return self._held[key][0]
        size = future.result().memory_size_bytes
        self._held[key], self._holders[key] = (future, size), 1
        self.bytes += size
        self.peak = max(self.peak, self.bytes)
        return future

    def release(self, key: tuple) -> None:
        self._holders[key] -= 1
        if not self._holders[key]:
            del self._holders[key]
            self.bytes -= self._held.pop(key)[1]


@dataclass
class _Waiting:
    seq: Sequence
    key: tuple
    future: Future | None = None   # None: its compile has not started


class GrammarQueue:
    """Structured-output sequences from arrival until their grammar is compiled and fits the
    budget; then `admit` hands them to the engine, holding their grammar until `release`.

    `compile(spec)` returns a future of the CompiledGrammar (the engine's GrammarManager, with its
    cache); a failed compile's future raises ValueError. Used from the engine's thread only."""

    def __init__(self, compile: Callable, max_bytes: int = MAX_GRAMMAR_BYTES, max_compiling: int = 2) -> None:
        self.compile = compile
        self.budget = GrammarBudget(max_bytes)
        self.max_compiling = max_compiling
        self.waiting: deque[_Waiting] = deque()
        self._holding: dict[int, tuple] = {}   # seq_id -> the key of the grammar it holds

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queue a sequence at the back, or ahead of the others if `first` (a fork that found its
        request's grammar gone: it keeps its request's place)."""
        entry = _Waiting(seq, seq.params.structured_outputs.key)
        self.waiting.appendleft(entry) if first else self.waiting.append(entry)

    def share(self, seq: Sequence):
        """The compiled grammar of the sequence's spec if a sequence holds it already, now held by
        this one too (it costs nothing more); None if none does. For forks (n > 1), whose request
        holds it: they start with it, not behind requests waiting for room."""
        key = seq.params.structured_outputs.key
        held = self.budget.held(key)
        if held is None:
            return None
        self.budget.acquire(key, held)
        self._holding[seq.seq_id] = key
        return held.result()

    def remove(self, seq: Sequence) -> bool:
        """Forget a waiting sequence (aborted); it holds nothing yet. False if it is not here."""
        for entry in self.waiting:
            if entry.seq is seq:
                self.waiting.remove(entry)
                return True
        return False

    def compiling(self) -> list[Future]:
        """The compiles the queue waits for."""
        return [e.future for e in self.waiting if e.future is not None and not e.future.done()]

    def admit(self) -> tuple[list[tuple[Sequence, object]], list[tuple[Sequence, str]]]:
        """(sequence, compiled grammar) of each that may start now, its grammar held from here on,
        and (sequence, why) of each whose grammar failed to compile; both leave the queue."""
        ready: list[tuple[Sequence, object]] = []
        failed: list[tuple[Sequence, str]] = []
        still: deque[_Waiting] = deque()
        compiling = len(self.compiling())
        while self.waiting:
            entry = self.waiting.popleft()
            if entry.future is None:
                entry.future = self.budget.held(entry.key)
                if entry.future is None and compiling < self.max_compiling:
                    entry.future = self.compile(entry.seq.params.structured_outputs)
                    compiling += not entry.future.done()
            if entry.future is None or not entry.future.done():
                still.append(entry)
                continue
            error = entry.future.exception()
            if error is not None:
                failed.append((entry.seq, str(error)))
                continue
            if not self.budget.fits(entry.key, entry.future.result().memory_size_bytes):
                # first come, first served: everyone behind it that needs a grammar waits too
                still.append(entry)
                break
            ready.append((entry.seq, self.budget.acquire(entry.key, entry.future).result()))
            self._holding[entry.seq.seq_id] = entry.key
        still.extend(self.waiting)
        self.waiting = still
        return ready, failed

    def release(self, seq: Sequence) -> None:
        """The sequence has left the engine: its share of its grammar goes (none if it held none)."""
        key = self._holding.pop(seq.seq_id, None)
        if key is not None:
            self.budget.release(key)
