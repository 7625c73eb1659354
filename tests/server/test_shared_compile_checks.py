"""Checks of one structured-output spec share the check under way (server/compile_workers.py): it
runs once for all its waiters, ends when the last of them leaves, and a request that comes as it
ends starts its own. The compile itself is replaced here; test_grammar_compile_limit.py runs it."""

from __future__ import annotations

import asyncio

import pytest

from nanoserve.server.compile_workers import CompileWorkers
from nanoserve.structured_outputs_params import StructuredOutputsParams


class Counted(CompileWorkers):
    """Workers whose compile waits for `release`, and counts its runs and its cancellations."""

    def __init__(self) -> None:
        super().__init__("{}", num_workers=2)
        self.runs = self.cancelled = 0
        self.release = asyncio.Event()

    async def _compiled(self, spec: StructuredOutputsParams, timeout: float) -> str | None:
        self.runs += 1
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return None if spec.regex == "ok" else f"bad {spec.regex}"


def run(test) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))


def test_one_spec_checked_at_once_by_many_runs_once():
    async def test():
        workers = Counted()
        checks = [asyncio.create_task(workers.check(StructuredOutputsParams(regex="ok"), 5)) for _ in range(12)]
        other = asyncio.create_task(workers.check(StructuredOutputsParams(regex="x"), 5))
        await asyncio.sleep(0.01)
        assert workers.runs == 2   # one per spec
        workers.release.set()
        assert await asyncio.gather(*checks) == [None] * 12 and await other == "bad x"
        assert await workers.check(StructuredOutputsParams(regex="ok"), 5) is None   # the verdict kept
        assert workers.runs == 2 and not workers._checking
    run(test)


def test_the_check_ends_when_its_last_waiter_leaves_and_a_late_request_starts_its_own():
    async def test():
        workers = Counted()
        spec = StructuredOutputsParams(regex="ok")
        first, second = (asyncio.create_task(workers.check(spec, 5)) for _ in range(2))
        await asyncio.sleep(0.01)
        first.cancel()
        await asyncio.sleep(0.01)
        assert workers.cancelled == 0   # one still waits for it
        second.cancel()
        late = asyncio.create_task(workers.check(spec, 5))   # before the cancel has landed
        for task in (first, second):
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.sleep(0.01)
        assert workers.cancelled == 1 and workers.runs == 2
        workers.release.set()
        assert await late is None
        assert not workers._checking
    run(test)
