"""Structured-output specs compiled in worker processes that are killed past a deadline.

xgrammar's compile time grows much faster than the spec: 1.6 KB of regex ("a*" 800 times) took
10 s on a 2-core CPU, 6 KB took 45 s, and the 128 KiB the spec limit allows would take days. A
compile cannot be interrupted, so on a thread it held that thread (and, in the engine, one of the
two grammar threads every structured request waits for) for as long as it ran. In a process of
its own, it is killed at the deadline and the request gets a 400; the engine only ever compiles
specs that compiled here in time. A crash of the compiler ends the worker, not the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import multiprocessing
import os
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection

from nanoserve.structured_outputs_params import StructuredOutputsParams

_START_TIMEOUT_S = 300.0  # importing xgrammar (and torch) and building the tokenizer info; not the spec's time
_VERDICTS = 4096  # specs whose verdict the front end remembers


class CompileTimeout(Exception):
    """The spec did not compile within the deadline; its worker was killed."""


class CompilersBusy(Exception):
    """No worker came free within the deadline: all of them were compiling other specs."""


def _serve(conn: Connection, tokenizer_info_json: str, parent_pid: int) -> None:
    """The worker: compile each spec it is sent, answer None (it compiles) or the reason it does not."""
    from nanoserve.lifetime import die_with_parent

    die_with_parent(parent_pid)
    import xgrammar as xgr

    from nanoserve.engine.grammar import compile_spec, compiler_for

    compiler = compiler_for(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json))
    conn.send(None)
    while True:
        try:
            spec = conn.recv()
        except EOFError:  # the front end is gone
            return
        try:
            compile_spec(compiler, spec)
            conn.send(None)
        except ValueError as exc:
            conn.send(str(exc)[:2000])


class _Worker:
    """One worker process, started when first needed and again, at once, after it is killed."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self.info = tokenizer_info_json
        self.process: multiprocessing.process.BaseProcess | None = None
        self.conn: Connection | None = None
        self._restart: asyncio.Task | None = None

    def restart_soon(self) -> asyncio.Task:
        """Start the process again in the background, so that the next check finds it (nearly) up."""
        if self._restart is None or self._restart.done():
            self._restart = asyncio.get_running_loop().create_task(self._start_quietly())
        return self._restart

    async def _start_quietly(self) -> None:
        with contextlib.suppress(Exception):  # one that failed is tried again by the next check
            await self.start()

    async def check(self, spec: StructuredOutputsParams, timeout: float) -> str | None:
        if self._restart is not None:
            await asyncio.shield(self._restart)  # a check cancelled here leaves the start to the next
            self._restart = None
        if self.process is None or not self.process.is_alive():
            await self.start()
        self.conn.send(spec)
        try:
            return await self._reply(timeout)
        except asyncio.TimeoutError:
            self._kill()  # still compiling: nothing else can end it
            raise CompileTimeout() from None
        except (EOFError, OSError):
            self._kill()
            return "the compiler crashed on it"
        except BaseException:
            self._kill()  # abandoned mid-compile (cancelled): its late answer would be read as the next one's
            raise

    async def start(self) -> None:
        self._kill()
        parent, child = multiprocessing.Pipe()
        # started on the event loop's thread: the kernel's parent-death signal follows the thread
        # that started a child, and a pool thread may exit while the worker lives on
        self.process = multiprocessing.get_context("spawn").Process(
            target=_serve, args=(child, self.info, os.getpid()), name="nanoserve-grammar-check", daemon=True)
        self.process.start()
        child.close()
        self.conn = parent
        try:
            await self._reply(_START_TIMEOUT_S)
        except BaseException:
            self._kill()
            raise

    async def _reply(self, timeout: float) -> str | None:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.wait_for(readable, timeout)
        finally:
            loop.remove_reader(fd)
        return self.conn.recv()  # a short message, all there once the pipe is readable

    def stop(self) -> None:
        """Kill the process and any start under way."""
        if self._restart is not None and not self._restart.done():
            self._restart.cancel()
        self._kill()

    def _kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join()
            self.process = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None


@dataclass
class _SharedCheck:
    """One spec's check under way, and how many requests wait for it."""

    task: asyncio.Task
    waiters: int = 0


class CompileWorkers:
    """A few workers; a check waits for an idle one on the event loop, not on a thread.

    The workers are first come, first served, and a slow spec holds one up to the deadline. A
    check waits for a worker at most the deadline too: without that bound, n slow specs held
    every new one back for n / workers deadlines (six of 10 s kept a trivial regex waiting 34 s),
    and the queue kept compiling specs long after a flood of them stopped. A spec checked before
    is answered from its remembered verdict without a worker, so one that an application sends
    with every request never waits. Only verdicts are kept, never grammars (~34 MB for a 128 KiB
    spec), under a digest of the spec rather than its text; a timeout is not a verdict (it
    depends on the load). A spec already being checked is not checked again: its checks wait for
    the one under way (a burst of one spec on a cold server took every worker and answered the
    rest "busy"), which ends when its last waiter leaves."""

    def __init__(self, tokenizer_info_json: str, num_workers: int = 2) -> None:
        self.workers = [_Worker(tokenizer_info_json) for _ in range(num_workers)]
        self._idle: asyncio.Queue[_Worker] | None = None
        self._first_start: asyncio.Future | None = None
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()
        self._checking: dict[bytes, _SharedCheck] = {}

    async def check(self, spec: StructuredOutputsParams, timeout: float) -> str | None:
        """None when the spec compiles within `timeout` seconds, else why it does not; raises
        CompilersBusy when no worker is free within `timeout`, CompileTimeout past the deadline."""
        key = hashlib.blake2b(repr(spec.key).encode(), digest_size=16).digest()
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            return self._verdicts[key]
        shared = self._checking.get(key)
        if shared is None:
            shared = self._checking[key] = _SharedCheck(
                asyncio.get_running_loop().create_task(self._verdict(key, spec, timeout)))
            shared.task.add_done_callback(lambda _: self._forget(key, shared))
        shared.waiters += 1
        try:
            return await asyncio.shield(shared.task)
        finally:
            shared.waiters -= 1
            if not shared.waiters and not shared.task.done():
                # no one waits for it: the worker is freed, and a request for the spec that comes
                # while the cancel lands starts a check of its own rather than join this one
                shared.task.cancel()
                self._forget(key, shared)

    def _forget(self, key: bytes, shared: _SharedCheck) -> None:
        if self._checking.get(key) is shared:
            del self._checking[key]

    async def _verdict(self, key: bytes, spec: StructuredOutputsParams, timeout: float) -> str | None:
        verdict = await self._compiled(spec, timeout)
        self._verdicts[key] = verdict
        if len(self._verdicts) > _VERDICTS:
            self._verdicts.popitem(last=False)
        return verdict

    async def _compiled(self, spec: StructuredOutputsParams, timeout: float) -> str | None:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for worker in self.workers:
                self._idle.put_nowait(worker)
            # every worker starts with the first spec, and specs wait their deadline for a worker
            # once they have started: importing xgrammar and torch took seconds, and a cold burst of
            # specs waited out their deadline behind the first two starts (503 "busy")
            self._first_start = asyncio.ensure_future(asyncio.wait([w.restart_soon() for w in self.workers]))
        await asyncio.shield(self._first_start)
        try:
            # a get that completes as the wait ends still returns its worker (wait_for and
            # asyncio.Queue are both cancellation-safe), so none is lost from the pool
            worker = await asyncio.wait_for(self._idle.get(), timeout)
        except asyncio.TimeoutError:
            raise CompilersBusy() from None
        try:
            return await worker.check(spec, timeout)
        finally:
            if worker.process is None:
                # killed: its start begins now, and the worker is free at once, so that a spec
                # waits its deadline only for workers that compile, never for one that starts
                worker.restart_soon()
            self._idle.put_nowait(worker)

    def close(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.stop()
