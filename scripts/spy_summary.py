"""Condense a py-spy `--format raw` profile (collapsed stacks) into where each thread's time goes.

    python scripts/spy_summary.py PROFILE.txt [--top 40] [--within "generate (nanoserve/engine/llm.py)"]

For each busy thread: its sample count, the functions that were running (self) and the functions
on the stack (inclusive), as a share of that thread's samples. A raw profile of a whole benchmark
is tens of MB; this is the part worth reading. `--within` keeps, of the threads that ever run the
named function (a substring of a frame), only the samples inside it (the timed part, not start-up); other threads are kept.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

_LINE = re.compile(r"\s*\(([^)]*?):\d+\)$")


def _function(frame: str) -> str:
    """'step (nanoserve/engine/core.py:120)' -> 'step (nanoserve/engine/core.py)': one row per function."""
    return _LINE.sub(lambda m: f" ({m.group(1).split('site-packages/')[-1]})", frame)


def _stacks(path: str, within: str | None) -> list[tuple[str, list[str], int]]:
    stacks = []
    with open(path) as profile:
        for line in profile:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if stack and count.isdigit():
                thread, *frames = stack.split(";")
                thread = thread.partition(":")[0]  # py-spy names a thread only once it knows the name
                stacks.append((thread, [_function(f) for f in frames] or ["(no Python frame)"], int(count)))
    if within:
        inside = [any(within in frame for frame in frames) for _, frames, _ in stacks]
        scoped = {thread for (thread, _, _), hit in zip(stacks, inside) if hit}
        stacks = [s for s, hit in zip(stacks, inside) if hit or s[0] not in scoped]
    return stacks


def summarize(path: str, top: int, within: str | None = None) -> str:
    samples: Counter[str] = Counter()
    own: dict[str, Counter[str]] = defaultdict(Counter)
    on_stack: dict[str, Counter[str]] = defaultdict(Counter)
    for thread, frames, count in _stacks(path, within):
        samples[thread] += count
        own[thread][frames[-1]] += count
        for frame in set(frames):
            on_stack[thread][frame] += count
    total = sum(samples.values())
    lines = [f"{total} samples, {len(samples)} threads"]
    for thread, n in samples.most_common():
        if n < 0.02 * total:
            break
        lines.append(f"\n== {thread}: {n} samples ({100 * n / total:.1f}% of all)")
        for title, counts in (("self", own[thread]), ("inclusive", on_stack[thread])):
            lines.append(f"-- {title}")
            lines += [f"{100 * c / n:6.1f}%  {name}" for name, c in counts.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--within", default=None, help="a function as printed, e.g. 'generate (nanoserve/engine/llm.py)'")
    args = parser.parse_args()
    print(summarize(args.profile, args.top, args.within))


if __name__ == "__main__":
    main()
