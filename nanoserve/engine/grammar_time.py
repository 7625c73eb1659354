"""The time grammar matchers take a step, bounded whatever the grammar.

Every request of a step waits for the step's grammar work: each constrained row's matcher accepts
the token just sampled, then fills its row of the next step's mask. Ordinary JSON schemas and
regexes take well under a millisecond a row. A grammar that parses one text many ways (EBNF such
as `x ::= [a-z ] | x x | x " " x`) grows slower token by token under xgrammar's Earley parser:
on the bundled model 92 ms a step after 10 tokens, 1.8 s after 110, so one such request held every
other stream of the server to a token every few seconds, and it compiled quickly and stayed within
every memory bound (grammar_state.py).

So each phase of the work is timed. Matchers work in one batch (on xgrammar's threads) as long as
the batch takes no longer than MAX_MATCHER_STEP_S plus ROW_ALLOWANCE_S a row of wall time; a slower
batch makes its matchers suspects, which from then on work one by one on the engine's thread, each
timed on its own. A suspect whose accept and fill of one step take longer than MAX_MATCHER_STEP_S
together is slow: the engine ends its request (`end_slow`). So are the slowest suspects of a step
whose suspects took longer than that all together (16 such requests, 72 rows, held a plain request
beside them to 34 s while none was over the bound alone), until the rest are within it. A lone row works on the engine's thread
too, so it is judged at once. Judged work is timed in the thread's CPU time: a busy machine that
keeps the engine waiting for a core ends no request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from nanoserve.engine.sequence import Sequence

MAX_MATCHER_STEP_S = 0.1
ROW_ALLOWANCE_S = 0.001
MAX_SUSPECTS = 4096   # ids of matchers long gone are forgotten past this (a new matcher may reuse one)


class MatcherClock:
    """Runs a step's grammar work over its matchers, timing it, and names the matchers that are too slow.

    Used from the engine's thread only; `clock` is replaceable for tests."""

    def __init__(self, limit_s: float = MAX_MATCHER_STEP_S, row_allowance_s: float = ROW_ALLOWANCE_S,
                 clock: Callable[[], float] = time.thread_time, wall: Callable[[], float] = time.perf_counter) -> None:
        self.limit_s = limit_s
        self.row_allowance_s = row_allowance_s
        self.clock = clock   # this thread's CPU time: what a matcher working here costs
        self.wall = wall     # a batch works on xgrammar's threads: its wall time
        self.suspects: dict[int, float] = {}   # id(matcher) -> seconds it has spent in this step so far
        self.slow: dict[int, tuple[Any, float]] = {}   # id -> (matcher, seconds); held until end_slow

    def run(self, matchers: list, alone: Callable[[Any, int], None], together: Callable[[list, list[int]], None],
            closes_step: bool) -> None:
        """One phase of the step's work: `alone(matcher, i)` for each suspect, `together(matchers,
        indices)` for the rest, i being a matcher's place in `matchers`. The accept phase opens a
        step's count (closes_step False), the fill closes it."""
        batch = range(len(matchers))   # the common case, no suspect: one batch, no pass over the rows
        if self.suspects:
            batch = [i for i, m in enumerate(matchers) if id(m) not in self.suspects]
            timed = [self._alone(m, i, alone, closes_step) for i, m in enumerate(matchers) if id(m) in self.suspects]
            if closes_step:
                self._judge_together(timed)
        if not batch:
            return
        start, wall = self.clock(), self.wall()
        together(matchers if len(batch) == len(matchers) else [matchers[i] for i in batch], list(batch))
        if len(batch) == 1:   # worked on this thread
            self._judge(matchers[batch[0]], self.clock() - start)
        elif self.wall() - wall > self.limit_s + self.row_allowance_s * len(batch):
            if len(self.suspects) + len(batch) > MAX_SUSPECTS:
                self.suspects.clear()
            self.suspects.update((id(matchers[i]), 0.0) for i in batch)

    def _alone(self, matcher: Any, i: int, alone: Callable[[Any, int], None], closes_step: bool) -> tuple[float, Any]:
        """A suspect's work on this thread, timed and judged; (its seconds this step, matcher)."""
        start = self.clock()
        alone(matcher, i)
        spent = self.clock() - start + (self.suspects[id(matcher)] if closes_step else 0.0)
        self.suspects[id(matcher)] = 0.0 if closes_step else spent
        self._judge(matcher, spent)
        return spent, matcher

    def _judge(self, matcher: Any, spent: float) -> None:
        if spent > self.limit_s:
            self.slow[id(matcher)] = (matcher, spent)

    def _judge_together(self, timed: list[tuple[float, Any]]) -> None:
        """The slowest suspects are slow too, until the others' time of this step is within the bound."""
        total = sum(spent for spent, _ in timed)
        for spent, matcher in sorted(timed, key=lambda t: -t[0]):
            if total <= self.limit_s:
                return
            self.slow.setdefault(id(matcher), (matcher, spent))
            total -= spent

    def end_slow(self, sequences: Iterable[Sequence], end: Callable[[Sequence, str], None]) -> None:
        """`end` the requests whose matcher was found too slow; once per step, before it runs."""
        if not self.slow:
            return
        for seq in list(sequences):
            if seq.grammar is not None and id(seq.grammar) in self.slow:
                spent = self.slow[id(seq.grammar)][1]
                self.suspects.pop(id(seq.grammar), None)
                end(seq, f"Ended after {seq.num_output_tokens} tokens: its structured-output grammar took "
                         f"{spent * 1e3:.0f} ms to follow one token, the most of the step's slow grammars (at most "
                         f"{self.limit_s * 1e3:.0f} ms, alone or together), and every request in the step waits for "
                         "that. A grammar that parses each text one way (not ambiguously, as x ::= x x does) stays fast")
        self.slow.clear()
