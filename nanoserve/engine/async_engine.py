"""The front end's engine client: requests go to the engine core over ZeroMQ, outputs come back as streams.

The engine core (engine/core.py) runs in a process of its own and owns the device. This side
owns what is per request and not per step: the tokenizer, prompt checks, admission, detokenizing
and stop strings (in RequestStream), so the core's loop never waits on HTTP work. One task reads
the core's per-step messages and routes each request's tokens to its stream.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from nanoserve.config import EngineConfig
from nanoserve.engine.admission import Admission, QueueFullError, SharedCounts
from nanoserve.engine.bad_words import with_bad_words_token_ids
from nanoserve.engine.core import EngineCore, run_engine_process
from nanoserve.engine.early_start import EarlyEngineProcess
from nanoserve.engine.ipc_dir import remove_socket_dir, socket_dir
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.messages import (AbortRequests, AddRequest, EngineDied, EngineOutputs, EngineReady, EngineStats,
                                       Shutdown, input_encoder, output_decoder)
from nanoserve.engine.outputs import RequestState
from nanoserve.engine.request_stream import EngineDeadError, RequestFailedError, RequestStream, RequestUpdate
from nanoserve.engine.tokenizer import load_tokenizer
from nanoserve.engine.validation import (RequestRefused, check_logprobs, check_params_token_ids, check_priority,
                                         check_prompt, check_token_ids, logprobs_cap)
from nanoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "CoreLink", "EngineDeadError", "EngineStats", "QueueFullError", "RequestFailedError",
           "RequestStream", "RequestUpdate"]

_SHUTDOWN_WAIT_S = 30.0  # for the core to close its workers before it is killed


def exit_reason(process: multiprocessing.process.BaseProcess, wait_s: float = 1.0) -> str:
    """How a process that closed its sentinel ended, for the log: its exit code, or the signal that
    killed it. The sentinel can close a moment before the process may be reaped, so it waits up to
    wait_s for the code."""
    process.join(wait_s)
    code = process.exitcode
    if code is None:
        return f"closed its pipe and is still running after {wait_s:g} s"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass(frozen=True)
class CoreLink:
    """How one of several front ends (`serve --api-server-count N`) reaches the engine core that the
    server's main process started: the core connects to both addresses, which this front end binds."""

    index: int            # this front end's number, 0 .. count-1; the core routes outputs by it
    count: int            # front ends sharing the core
    input_address: str    # ZeroMQ addresses (ipc://...)
    output_address: str
    core_pid: int         # watched: the core is not this process's child
    admitted: Any = None  # each front end's admitted sequences (admission.SharedCounts' slots)


class AsyncEngine:
    """Serves many asyncio callers from one engine core.

    By default the core runs in a child process, started by `await start()`; pass `engine` to
    run an already-built LLMEngine on a thread of this process instead (tests), or `link` to share
    a core that another process started with other front ends. At most
    `max_num_seqs + max_queue_len` sequences (prompts × n) are admitted at once: running ones
    plus those that wait; past that `add_request` raises QueueFullError (the server's 503). Front
    ends that share a core count each other's admitted sequences in memory they share.
    """

    def __init__(self, config: EngineConfig, max_queue_len: int | None = None, engine: LLMEngine | None = None,
                 log_level: str = "INFO", link: CoreLink | None = None, early: EarlyEngineProcess | None = None) -> None:
        self.config = engine.config if engine is not None else config
        self.tokenizer = (engine.tokenizer if engine is not None
                          else load_tokenizer(self.config.tokenizer, self.config.trust_remote_code))
        self.vocab_size = self.config.hf_config.vocab_size
        self.logprobs_cap = logprobs_cap(self.config.max_logprobs, self.vocab_size)
        shared = SharedCounts(link.admitted, link.index) if link is not None and link.admitted is not None else None
        self.admission = Admission(self.config.max_num_seqs, max_queue_len, shared)
        self.log_level = log_level
        self.ready: EngineReady | None = None
        self.error: EngineDeadError | None = None
        self.crashed = False                 # the core died on its own, not stopped by shutdown()
        self.dead = asyncio.Event()          # set once the core is gone, for whoever must act on it
        self._engine = engine
        self._link = link
        self._client = link.index if link is not None else 0
        self._streams: dict[str, RequestStream] = {}  # engine request id -> its stream, while unfinished
        self._stats = EngineStats()
        self._last_heard = time.monotonic()  # when the core last sent anything
        # the sockets' folder; a front end that shares a core binds in the folder of the process
        # that started it, and makes none: one of its own outlived it when it was killed
        self._dir = socket_dir("output") if link is None else None
        self._context = zmq.asyncio.Context()
        self._inputs = self._context.socket(zmq.PUSH)
        self._outputs = self._context.socket(zmq.PULL)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._early = early   # the core's process, started before this one loaded, waiting for its arguments
        self._core_watch: int | None = None   # a pidfd of a core started by another process
        self._thread: threading.Thread | None = None
        self._reader: asyncio.Task | None = None
        self._ready = None  # the future `start()` awaits
        self._stopping = False

    @property
    def healthy(self) -> bool:
        return self.ready is not None and self.error is None

    @property
    def silent_seconds(self) -> float:
        """Since the core last sent anything; it sends a heartbeat every second, idle or busy, so a
        long silence means a stuck core (a step that never returns)."""
        return time.monotonic() - self._last_heard if self.ready is not None else 0.0

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def num_unfinished(self) -> int:
        """Sequences admitted here and not finished: those running and those waiting."""
        return len(self._streams)

    async def start(self) -> EngineReady:
        """Start the core, wait until its model is loaded; raise EngineDeadError if it fails to start."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        if self._link is not None:
            input_address, output_address = self._link.input_address, self._link.output_address
        else:
            input_address, output_address = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._inputs.bind(input_address)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.bind(output_address)
        self._reader = asyncio.create_task(self._read_outputs())
        if self._link is not None:
            self._watch_core(self._link.core_pid)
        elif self._engine is not None:
            core = EngineCore([input_address], [output_address])
            self._thread = threading.Thread(target=self._run_thread, args=(core, self._engine),
                                            name="nanoserve-engine", daemon=True)
            self._thread.start()
            self._engine = None  # the thread owns it now
        else:
            args = (self.config, [input_address], [output_address], os.getpid(), self.log_level)
            if self._early is not None:
                self._process = self._early.run(*args)
            else:
                spawn = multiprocessing.get_context("spawn")  # a CUDA context cannot be forked
                self._process = spawn.Process(target=run_engine_process, name="nanoserve-engine", args=args)
                self._process.start()
            loop.add_reader(self._process.sentinel, self._process_exited)
        self.ready = await self._ready
        return self.ready

    def _watch_core(self, pid: int) -> None:
        """Learn at once that a core this process did not start has exited, as a child's sentinel tells."""
        try:
            self._core_watch = os.pidfd_open(pid)
        except (AttributeError, OSError):   # no pidfd here (or it is gone): the heartbeat's silence tells
            logger.warning("Cannot watch the engine process %d; a silent engine shows as a stall", pid)
            return
        asyncio.get_running_loop().add_reader(self._core_watch, self._core_exited)

    def _core_exited(self) -> None:
        self._stop_watching()
        if not self._stopping and self.error is None:
            logger.error("The engine process %d exited", self._link.core_pid)
        self._mark_dead(EngineDeadError("The engine stopped unexpectedly; the server must be restarted"))

    def _stop_watching(self) -> None:
        if self._core_watch is not None:
            asyncio.get_running_loop().remove_reader(self._core_watch)
            os.close(self._core_watch)
            self._core_watch = None

    @staticmethod
    def _run_thread(core: EngineCore, engine: LLMEngine) -> None:
        try:
            core.run(engine)
        except BaseException:  # noqa: BLE001 - already logged and reported as EngineDied by the core
            pass

    async def shutdown(self) -> None:
        """Stop the core; requests still in flight fail with EngineDeadError."""
        self._stopping = True
        if self._link is not None:   # the core stops once every front end has said so
            self._stop_watching()
            if self.error is None:
                self._inputs.send(input_encoder.encode(Shutdown()))
        elif self._process is not None or self._thread is not None:
            if self.error is None:
                self._inputs.send(input_encoder.encode(Shutdown()))
            worker = self._process or self._thread
            await asyncio.to_thread(worker.join, _SHUTDOWN_WAIT_S)
            if self._process is not None:
                asyncio.get_running_loop().remove_reader(self._process.sentinel)
                if self._process.is_alive():
                    logger.warning("The engine core did not stop in %.0f s; killing it", _SHUTDOWN_WAIT_S)
                    self._process.kill()
                    self._process.join()
        self._mark_dead(EngineDeadError("The server is shutting down"))
        if self._reader is not None:
            self._reader.cancel()
        self._inputs.close(linger=1000 if self._link is not None else 0)   # the Shutdown must go out
        self._outputs.close(linger=0)
        self._context.term()
        if self._dir is not None:
            remove_socket_dir(self._dir)

    def check_token_ids(self, token_ids: list[int], what: str) -> None:
        """Raise RequestRefused for an id outside the vocabulary."""
        check_token_ids(token_ids, self.vocab_size, what)

    def add_request(self, request_id: str, prompts: Sequence[list[int]], params: SamplingParams,
                    keep_outputs: bool = True, priority: int = 0, stream_interval: int = 1) -> RequestStream:
        """Check and queue one request of one or more prompts; iterate the stream for outputs.

        With `keep_outputs` false the stream's `outputs` keep only token counts: a caller that uses
        each update as it comes (a streamed response) need not hold what it already sent.

        Choice `p * n + i` is the i-th completion of prompt p (the OpenAI API's order). n > 1
        becomes n engine requests that fork from the first once its prompt is cached, sharing its
        KV blocks. Raises ValueError for a prompt that cannot be served, QueueFullError when too
        many sequences wait, EngineDeadError when the core is gone; nothing is queued then. The
        ValueErrors are RequestRefused, which name the field to change. `priority` orders requests
        under the engine's priority policy (lower first); it must be 0 under first come, first served.
        `stream_interval`: the stream wakes its reader once a choice has this many new tokens (its
        first and last come at once).
        """
        if not self.healthy:
            raise self.error or EngineDeadError("The engine is not running yet")
        if not prompts:
            raise RequestRefused("The request has no prompt", "prompt")
        check_params_token_ids(params, self.vocab_size)
        check_logprobs(params, self.logprobs_cap)
        check_priority(priority, self.config.scheduling_policy)
        for prompt in prompts:
            check_prompt(prompt, params.max_tokens, self.config.max_model_len, self.vocab_size,
                         params.min_tokens)
        n = params.n
        ids = ([request_id] if len(prompts) * n == 1
               else [f"{request_id}-{c}" for c in range(len(prompts) * n)])
        if any(rid in self._streams for rid in ids):
            raise RequestRefused(f"Request id {request_id!r} is already in use")
        # past what the server ever holds, the request is too large by n, or by its prompts
        self.admission.check(len(ids), self.num_unfinished, "n" if len(prompts) == 1 else "prompt")
        try:   # the claim check() made is settled whatever happens: kept if registered, else given back
            params = with_bad_words_token_ids(params, self.tokenizer)   # here, once, not per choice in the core
            try:  # encoded before anything is registered: a request the core cannot receive leaves no trace
                frame = input_encoder.encode(AddRequest(ids[::n], [list(p) for p in prompts], params,
                                                        [ids[p * n + 1:(p + 1) * n] for p in range(len(prompts))],
                                                        priority, self._client))
            except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as exc:
                raise RequestRefused(f"The request cannot be passed to the engine: {exc}") from None
            states = [RequestState(self.tokenizer, prompts[c // n], params, c, keep=keep_outputs)
                      for c in range(len(ids))]
            stream = RequestStream(ids, states, self.abort, stream_interval)
            for rid in ids:
                self._streams[rid] = stream
        finally:
            self.admission.settle(len(self._streams))
        self._send_frame(frame)
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drop these requests in the core and free their blocks; unknown ids are ignored."""
        for rid in request_ids:
            self._streams.pop(rid, None)
        self.admission.settle(len(self._streams))
        if request_ids and self.error is None:
            self._send(AbortRequests(list(request_ids)))

    def _send(self, message) -> None:
        self._send_frame(input_encoder.encode(message))

    def _send_frame(self, frame: bytes) -> None:
        self._inputs.send(frame, flags=zmq.NOBLOCK, copy=False)

    # ---- outputs of the core

    async def _read_outputs(self) -> None:
        while True:
            frame = await self._outputs.recv(copy=False)
            self._last_heard = time.monotonic()
            try:
                message = output_decoder.decode(frame.buffer)
                if isinstance(message, EngineOutputs):
                    self._dispatch(message)
                elif isinstance(message, EngineReady):
                    # vLLM's "maximum concurrency": sequences of max_model_len the cache holds at once
                    # (under a sliding window each holds its window's blocks, not its length's)
                    logger.info("Engine ready: %d KV-cache blocks of %d tokens (%d tokens; %.1f sequences of "
                                "max_model_len %d at once) on %s, %s, loaded in %.1f s, CUDA graphs captured in %.1f s",
                                message.num_blocks, message.block_size, message.num_blocks * message.block_size,
                                message.num_blocks / self.config.blocks_per_sequence(), self.config.max_model_len,
                                message.device, message.dtype, message.load_seconds, message.graph_capture_seconds)
                    # the cache's size is known from the start, not only after a first request
                    self._stats = EngineStats(num_blocks=message.num_blocks, num_free_blocks=message.num_blocks)
                    self._ready.set_result(message)
                elif isinstance(message, EngineDied):
                    logger.error("The engine core stopped: %s", message.message)
                    self._mark_dead(EngineDeadError("The engine stopped unexpectedly; the server must be restarted"))
            except Exception:  # noqa: BLE001 - one bad message must not stop the routing of all others
                logger.exception("Could not handle a message from the engine core")

    def _dispatch(self, message: EngineOutputs) -> None:
        self._stats = message.stats
        done: list[str] = []     # finished on this side while the core still runs them (stop strings)
        for failure in message.failed:
            self._fail(failure.request_ids, RequestFailedError(failure.message, own_fault=True))
        for step in message.outputs:
            stream = self._streams.get(step.request_id)
            if stream is None:
                continue  # its client is gone and the abort is on its way
            try:
                if stream.on_step(step):
                    del self._streams[step.request_id]
                    self.admission.finished()
                    if not step.finished:
                        done.append(step.request_id)
            except Exception:  # noqa: BLE001 - detokenizing one request must not fail the others
                logger.exception("Failed to process the output of request %s", step.request_id)
                self._fail([step.request_id], RequestFailedError("The server failed to process this request's "
                                                                 "output"))
        if done:
            self._send(AbortRequests(done))
        self.admission.settle(len(self._streams))

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        streams = {self._streams.get(rid) for rid in request_ids} - {None}
        for stream in streams:
            stream.fail(exc)
            stream.close()

    def fail_all(self, exc: BaseException) -> None:
        """End every open request with `exc`; the engine goes on (the shutdown deadline uses it)."""
        self._fail(list(self._streams), exc)

    def _process_exited(self) -> None:
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if self._stopping:
            return  # shutdown() is waiting for this
        if self.error is None:
            logger.error("The engine process %s", exit_reason(self._process))
        self._mark_dead(EngineDeadError("The engine stopped unexpectedly; the server must be restarted"))

    def _mark_dead(self, error: EngineDeadError) -> None:
        if self.error is None:
            self.error = error
            self.crashed = not self._stopping
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(self.error)
        self.fail_all(self.error)
        self.dead.set()
