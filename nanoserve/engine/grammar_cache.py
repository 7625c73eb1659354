"""Compiled grammars kept for reuse, bounded by their number and by the memory they hold.

A spec of the largest size a request may give (128 KiB of choices, regex or grammar text)
compiles to ~34 MB of xgrammar's tables. Kept by number alone (1,024 of them), each distinct
such spec grew the engine by ~75 MB for good: 16 requests made it 1.2 GB larger, and a few
hundred would have had the kernel kill it for memory. xgrammar's own cache, even given a byte
limit, grew the same way (and made a large compile four times slower), so it is off
(grammar.compiler_for) and this one bounds what stays.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future

MAX_ENTRIES = 1024
# at xgrammar's own count of a grammar's size (the process holds ~1.25x that): eight of the
# largest specs, or a thousand ordinary JSON schemas (~0.2 MB each)
MAX_BYTES = 256 << 20


class CompileCache:
    """Compile futures by spec key; the least recently used go first once there are more than
    `max_entries` of them or their compiled grammars hold more than `max_bytes`. The newest entry
    stays however large it is, so that the forks of its request find it.

    A grammar's size is known once its compile is done: entries still compiling count for nothing
    until a later `get` or `put` sees them done. Used from the engine's thread only."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._futures: OrderedDict[tuple, Future] = OrderedDict()
        self._sizes: dict[tuple, int] = {}                 # bytes of each entry whose compile is done
        self._compiling: list[tuple[tuple, Future]] = []   # entries not done when last looked at
        self.bytes = 0                                     # the sum of _sizes

    def __len__(self) -> int:
        return len(self._futures)

    def get(self, key: tuple) -> Future | None:
        future = self._futures.get(key)
        if future is not None:
            self._futures.move_to_end(key)
        self._evict()
        return future

    def put(self, key: tuple, future: Future) -> None:
        self._futures[key] = future
        self._compiling.append((key, future))
        self._evict()

    def _evict(self) -> None:
        still = []
        for key, future in self._compiling:
            if not future.done():
                still.append((key, future))
            elif self._futures.get(key) is future:   # not dropped (and put again) while it compiled
                self._sizes[key] = _size(future)
                self.bytes += self._sizes[key]
        self._compiling = still
        while len(self._futures) > 1 and (len(self._futures) > self.max_entries or self.bytes > self.max_bytes):
            key, _ = self._futures.popitem(last=False)
            self.bytes -= self._sizes.pop(key, 0)


def _size(future: Future) -> int:
    """Bytes of a done compile's grammar; a spec that failed to compile holds none."""
    if future.cancelled() or future.exception() is not None:
        return 0
    return future.result().memory_size_bytes
