"""The idle-gap summary of bench/prefill.py --profile, on hand-made GPU events: gaps are measured
from the latest end so far (overlapping ops leave none), and averaged per call by the ops around them."""

from __future__ import annotations

from types import SimpleNamespace

from nanoserve.benchmarks.gpu_profile import print_idle_gaps


def op(name: str, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_idle_gaps_are_summed_per_pair_of_ops_and_averaged_over_calls(capsys) -> None:
    # two calls of a -> b; in the first, c overlaps b and a long op hides no gap behind a short one
    events = [op("b", 30, 40), op("a", 0, 10), op("c", 35, 50), op("a", 100, 110), op("b", 130, 140),
              op("long", 140, 200), op("short", 150, 160), op("after", 205, 210)]
    print_idle_gaps(events, calls=2, count=3)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].strip() == "idle between GPU ops: 48 us per call; longest:"   # (20 + 50 + 20 + 5) / 2
    assert lines[1].split() == ["25.0", "us/call", "0.5/call", "c", "->", "a"]
    assert lines[2].split() == ["20.0", "us/call", "1.0/call", "a", "->", "b"]
    assert lines[3].split() == ["2.5", "us/call", "0.5/call", "short", "->", "after"]
