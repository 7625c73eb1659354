"""Distinct structured-output specs of the largest sizes allowed leave only what the engine keeps
of them, within its budget (tests/engine/test_grammar_cache.py): the front end's compile workers
keep verdicts, not grammars, and nothing keeps a second copy."""

from __future__ import annotations

import random
import string
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.server.conftest import spawned_children

SPECS = 4
CHOICES, CHOICE_CHARS = 1024, 60   # 62 KiB of choices (at most 128 KiB): ~16 MB compiled


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def test_distinct_large_specs_are_kept_once_by_the_engine_alone(server):
    rng = random.Random(0)

    def choices() -> list[str]:
        return ["".join(rng.choice(string.ascii_letters) for _ in range(CHOICE_CHARS)) for _ in range(CHOICES)]

    def ask_each(specs: list[list[str]]) -> list[int]:
        def ask(spec: list[str]) -> int:
            body = {"model": "tiny", "prompt": "A", "max_tokens": 1, "guided_choice": spec}
            return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code

        with ThreadPoolExecutor(2) as pool:   # two at a time: one in each compile worker
            return list(pool.map(ask, specs))

    # the compile workers are started, and each has compiled a large spec once (what that leaves
    # is the allocator's high-water mark, not a grammar)
    assert ask_each([choices(), choices()]) == [200, 200]
    processes = spawned_children(server.proc.pid)   # the engine core and the workers
    before = sum(map(rss_mb, processes))
    assert ask_each([choices() for _ in range(SPECS)]) == [200] * SPECS
    grown = sum(map(rss_mb, processes)) - before
    # each spec stayed in xgrammar's caches, in the engine (~37 MB) and in a worker (~20 MB), for
    # good; now the engine holds its one copy (~20 MB) until its budget pushes it out
    assert grown < SPECS * 30, f"{grown:.0f} MB more after {SPECS} distinct large specs"
    server.wait_idle()
