"""The memory of grammar matchers in use, bounded whatever the grammar.

A compiled grammar's size is known (grammar_queue.py budgets it); a matcher's is not. xgrammar
0.2.9's GrammarMatcher keeps every Earley state set it has been through, for rollback, and nothing
in its API bounds or reports that: `max_rollback_tokens` is ignored, and `reset()` and
`rollback()` free nothing. Measured per matcher and accepted token: ~0.05 KB for `[a-z ]*`,
~8.5 KB for `[a-z]{0,5000}` (bundled tokenizer), so 256 such sequences of 4k tokens hold ~9 GB,
and only deleting the matcher gives it back.

So the engine watches its own resident memory, once per step while any sequence holds a grammar
(a pread of /proc/self/statm: ~4 us a step; glibc's mallinfo2 would count only bytes in use, but
it walks every free chunk: 0.76 s once 64 threads had fragmented their arenas). What the engine
grew by since the last step at which no sequence held a grammar, less the compiled grammars they
hold (budgeted apart, by xgrammar's figure), is charged to the sequences holding one. Past
`max_bytes`, freed memory is first given back (malloc_trim: resident memory keeps freed pages
until then), then the sequence that has accepted the most tokens is ended, its matcher freed,
and so on until the growth is within the limit again or no sequence holds a grammar. Requests
without a grammar are never ended by this. Other growth while grammars are held (the compile
cache, plain requests' token lists) counts too: the default limit leaves room for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Iterable

from nanoserve.engine.sequence import Sequence

_STATM = "/proc/self/statm"


def _libc_trim() -> Callable[[], None]:
    """glibc's malloc_trim(0): freed heap pages go back to the kernel, so resident memory falls."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):   # not glibc: resident memory falls where the allocator lets it
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class ResidentBytes:
    """This process's resident memory in bytes, read cheaply (the file stays open); None where
    /proc is missing (the guard then does nothing)."""

    def __init__(self) -> None:
        self._fd = os.open(_STATM, os.O_RDONLY) if os.path.exists(_STATM) else None
        self._page = os.sysconf("SC_PAGE_SIZE") if self._fd is not None else 0

    def __call__(self) -> int | None:
        if self._fd is None:
            return None
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class GrammarStateGuard:
    """Tells the engine when the memory grown while sequences hold grammars passes `max_bytes`.

    `probe()` is the process's memory in bytes (None: unknown), `trim()` returns freed memory to
    the kernel; both replaceable for tests. Used from the engine's thread only."""

    def __init__(self, max_bytes: int, probe: Callable[[], int | None] | None = None,
                 trim: Callable[[], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self.probe = probe if probe is not None else ResidentBytes()
        self.trim = trim if trim is not None else _libc_trim()
        self.baseline: int | None = None   # the memory at the last step at which no grammar was held
        self.peak_growth = 0               # the most growth seen (for tests and logs)
        self.compiled_bytes = 0            # compiled grammars in use (budgeted apart, grammar_queue.py)

    def growth(self) -> int:
        now = self.probe()
        if now is None or self.baseline is None:
            return 0
        growth = now - self.baseline - self.compiled_bytes
        self.peak_growth = max(self.peak_growth, growth)
        return growth

    def over(self, holding: bool, compiled_bytes: int = 0) -> bool:
        """Once per step: whether the growth is past the limit. `holding`: whether any sequence
        holds a grammar; while none does, whatever the engine holds is not grammar state.
        `compiled_bytes`: xgrammar's figure of the compiled grammars they hold, not counted."""
        self.compiled_bytes = compiled_bytes
        if not holding:
            self.baseline = self.probe()
            return False
        return self.growth() > self.max_bytes

    def still_over(self) -> bool:
        """After a sequence was ended: whether the growth is still past the limit."""
        self.trim()   # freed matcher state sits in malloc's free lists until trimmed
        return self.growth() > self.max_bytes

    def enforce(self, holding: bool, compiled_bytes: int, sequences: Iterable[Sequence], end: Callable[[Sequence, str], None]) -> None:
        """Once per step, before anything runs: past the limit, `end` the sequences holding a
        grammar, those that have accepted the most tokens first, until it is kept again. A grammar
        whose last holder is ended may stay in use by xgrammar's figure until the next step."""
        # memory freed since (a compile's scratch) may not show until trimmed: the rare case pays
        if not self.over(holding, compiled_bytes) or not self.still_over():
            return
        for seq in sorted((s for s in sequences if s.grammar is not None), key=lambda s: -s.num_output_tokens):
            end(seq, f"Ended after {seq.num_output_tokens} tokens: the state that structured outputs' grammars "
                     f"accumulate token by token grew the engine's memory past --max-grammar-state-bytes "
                     f"({self.max_bytes / (1 << 20):.0f} MiB); this request had accepted the most. A grammar "
                     "with smaller repetition bounds, or a lower max_tokens, holds less")
            if not self.still_over():
                return
