"""Which Triton kernels compile inside a timed region: a compile there is time the benchmark
charges to serving (and, in a server, a stall of every running request), so it is reported."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def triton_compiles() -> Iterator[dict[str, list[float]]]:
    """Yields {kernel name: [seconds of each compile]} filled while the block runs (empty without Triton)."""
    seen: dict[str, list[float]] = defaultdict(list)
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        JITFunction = None
    original = getattr(JITFunction, "_do_compile", None)
    if original is None:  # no Triton, or another Triton: nothing to watch
        yield seen
        return

    def watched(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            seen[getattr(self, "__name__", repr(self))].append(time.perf_counter() - start)

    JITFunction._do_compile = watched
    try:
        yield seen
    finally:
        JITFunction._do_compile = original


def describe(compiles: dict[str, list[float]]) -> str:
    return ", ".join(f"{name} x{len(times)} ({sum(times):.2f} s)" for name, times in compiles.items())
