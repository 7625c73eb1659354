"""The engine behind the HTTP server: one thread owns LLMEngine, asyncio tasks stream its output.

The engine thread loops `step()` while there is work and sleeps on a condition when idle. The
asyncio side talks to it through an inbox (add, abort) guarded by that condition; each step's
outputs come back in one `loop.call_soon_threadsafe` call and are routed to per-request queues.
Detokenization (RequestState) runs on the asyncio side, so the engine thread only steps.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import CompletionOutput, RequestState, StepOutput, TokenLogprob
from nanoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an internal error or shutdown); no request can be served."""


class QueueFullError(RuntimeError):
    """More requests are waiting than the server admits; the client should retry later."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot published by the engine thread after every step; safe to read from any thread."""

    num_running: int = 0
    num_waiting: int = 0            # in the scheduler's queue, plus adds not yet taken from the inbox
    num_blocks: int = 0
    num_free_blocks: int = 0        # free or cached-but-unreferenced: what new requests can take
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache, ever
    prefix_hit_tokens: int = 0      # of those, found there
    num_preemptions: int = 0

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self.blocks_in_use / self.num_blocks if self.num_blocks else 0.0


@dataclass(frozen=True)
class RequestUpdate:
    """What one engine step added to one of the n choices of a request."""

    index: int                              # which choice: p * n + i for the i-th of prompt p
    text: str                               # new text that is safe to show (may be empty)
    token_ids: list[int]                    # new tokens
    logprobs: list[TokenLogprob] | None     # one entry per new token when logprobs were asked for
    finish_reason: str | None               # "stop" or "length" on the choice's last update
    num_prompt_tokens: int
    num_cached_tokens: int                  # prompt tokens found in the prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first update, when asked for


class RequestStream:
    """The outputs of one request (every choice of every prompt) as an async iterator of RequestUpdate.

    `close()` aborts whatever has not finished; call it when the consumer goes away (client
    disconnect, error). `outputs` holds each choice's whole text and tokens so far.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str], states: list[RequestState]) -> None:
        self._engine = engine
        self.request_ids = request_ids
        self._states = dict(zip(request_ids, states))
        self._unfinished = set(request_ids)
        self._queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self.outputs: list[CompletionOutput] = [state.output for state in states]
        self.closed = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> AsyncIterator[RequestUpdate]:
        return self._updates()

    async def _updates(self) -> AsyncIterator[RequestUpdate]:
        try:
            while self._unfinished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                update = self._apply(item)
                if update is not None:
                    yield update
        finally:
            self.close()

    def _apply(self, step: StepOutput) -> RequestUpdate | None:
        state = self._states[step.request_id]
        if step.request_id not in self._unfinished:
            return None  # steps already in flight when a stop string ended the choice
        out = state.update(step)
        if state.stopped and not step.finished:
            self._engine.abort([step.request_id])
        if out.finished:
            self._unfinished.discard(step.request_id)
        return RequestUpdate(out.index, out.text_delta, step.new_token_ids, step.logprobs, out.finish_reason,
                             step.num_prompt_tokens, step.num_cached_tokens, step.prompt_logprobs)

    def push(self, item: StepOutput | BaseException) -> None:
        """Called on the event loop with an engine output for one of its choices, or an error for all."""
        self._queue.put_nowait(item)

    def close(self) -> None:
        """Abort the unfinished choices and stop routing outputs here. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._engine._detach(self)
        # ids are in choice order, so each prompt's first request is aborted before its siblings:
        # aborting it releases those that still wait to fork from it
        unfinished = [rid for rid in self.request_ids if rid in self._unfinished]
        if unfinished:
            self._engine.abort(unfinished)


class AsyncEngine:
    """Runs an LLMEngine on a background thread for many concurrent asyncio callers.

    Call `start()` from the event loop that will consume outputs, and `shutdown()` when done.
    `max_queue_len` bounds the requests waiting to be scheduled: past it `add_request` raises
    QueueFullError (the server's 503). An exception in the loop fails every request in flight
    with EngineDeadError and leaves `healthy` False.
    """

    def __init__(self, config: EngineConfig, max_queue_len: int | None = None,
                 engine: LLMEngine | None = None) -> None:
        self.engine = engine or LLMEngine(config)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.max_queue_len = max_queue_len
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []       # ("add", id, prompt, params, fork_ids) | ("abort", ids)
        self._pending_adds = 0
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}  # engine request id -> its stream
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._stats = self._snapshot()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def stats(self) -> EngineStats:
        return self._stats

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the loop; requests still in flight fail with EngineDeadError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._fail_all(EngineDeadError("The server is shutting down"))
        await asyncio.to_thread(self.engine.close)

    def check_prompt(self, prompt_token_ids: list[int], max_tokens: int | None) -> None:
        """Raise ValueError (naming the numbers) if the prompt cannot be served as asked."""
        # reads only the config and vocabulary size, which never change: safe off the engine thread
        self.engine.check_prompt(prompt_token_ids, max_tokens)

    def check_token_ids(self, token_ids: list[int], what: str) -> None:
        """Raise ValueError for an id outside the vocabulary; like check_prompt, safe on any thread."""
        self.engine.check_token_ids(token_ids, what)

    def add_request(self, request_id: str, prompts: Sequence[list[int]], params: SamplingParams) -> RequestStream:
        """Validate and queue one request of one or more prompts; iterate the stream for outputs.

        Choice `p * n + i` is the i-th completion of prompt p (the OpenAI API's order). n > 1
        becomes n engine requests that fork from the first once its prompt is cached, sharing its
        KV blocks. Raises ValueError for a prompt that cannot be served, QueueFullError when too
        many requests wait, EngineDeadError when the engine loop is gone; nothing is queued then.
        """
        if not self.healthy:
            raise EngineDeadError("The engine is not running: " + (repr(self.error) if self.error else
                                                                   "it was never started or has shut down"))
        if not prompts:
            raise ValueError("The request has no prompt")
        for prompt in prompts:
            self.check_prompt(prompt, params.max_tokens)
        n = params.n
        ids = ([request_id] if len(prompts) * n == 1
               else [f"{request_id}-{c}" for c in range(len(prompts) * n)])
        if any(rid in self._streams for rid in ids):
            raise ValueError(f"Request id {request_id!r} is already in use")
        states = [RequestState(self.tokenizer, prompts[c // n], params, c) for c in range(len(ids))]
        stream = RequestStream(self, ids, states)
        with self._cond:
            waiting = self._stats.num_waiting + self._pending_adds
            # refuse only when the queue is already full, so that a request of more prompts than
            # max_queue_len can still get in when the server is idle
            if self.max_queue_len is not None and waiting >= self.max_queue_len:
                raise QueueFullError(f"{waiting} requests are already waiting (max_queue_len "
                                     f"{self.max_queue_len}); retry later")
            for rid in ids:
                self._streams[rid] = stream
            for p, prompt in enumerate(prompts):
                group = ids[p * n:(p + 1) * n]
                self._inbox.append(("add", group[0], list(prompt), params, group[1:]))
            self._pending_adds += len(prompts)
            self._cond.notify()
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        """Ask the engine thread to drop these requests and free their blocks; unknown ids are ignored."""
        with self._cond:
            self._inbox.append(("abort", list(request_ids)))
            self._cond.notify()

    def _detach(self, stream: RequestStream) -> None:
        for rid in stream.request_ids:
            if self._streams.get(rid) is stream:
                del self._streams[rid]

    # ---- the engine thread

    def _run(self) -> None:
        try:
            if self.config.device.startswith("cuda:"):
                # the current device is per thread: make it the engine's, not cuda:0 by default
                torch.cuda.set_device(torch.device(self.config.device))
            while True:
                with self._cond:
                    while not (self._inbox or self._stopping or self.engine.has_unfinished_requests()):
                        self._cond.wait()
                    if self._stopping:
                        return
                    inbox, self._inbox, self._pending_adds = self._inbox, [], 0
                    self._apply_inbox(inbox)
                    self._stats = self._snapshot()
                outputs = self.engine.step()
                self._stats = self._snapshot()
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as exc:  # noqa: BLE001 - whatever it is, every waiting client must hear of it
            logger.exception("The engine loop failed; failing all requests in flight")
            self.error = exc
            self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(
                f"The engine failed and stopped ({exc!r}); restart the server"))

    def _apply_inbox(self, inbox: list[tuple]) -> None:
        for op in inbox:
            if op[0] == "abort":
                for rid in op[1]:
                    self.engine.abort_request(rid)
                continue
            _, rid, prompt, params, fork_ids = op
            try:
                self.engine.add_request(rid, prompt, params, fork_ids=fork_ids)
            except ValueError as exc:  # this request alone is bad; the engine is fine
                self._loop.call_soon_threadsafe(self._fail_request, [rid, *fork_ids], exc)

    def _snapshot(self) -> EngineStats:
        bm = self.engine.block_manager
        return EngineStats(self.engine.num_running, self.engine.num_waiting, bm.num_blocks, bm.num_free_blocks,
                           bm.prefix_queried_tokens, bm.prefix_hit_tokens, self.engine.scheduler.num_preemptions)

    # ---- the asyncio side

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for step in outputs:
            stream = self._streams.get(step.request_id)
            if stream is not None:  # None: its client is gone and the abort is on its way
                stream.push(step)

    def _fail_request(self, request_ids: list[str], exc: BaseException) -> None:
        streams = {self._streams.get(rid) for rid in request_ids} - {None}
        for stream in streams:
            stream.push(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in set(self._streams.values()):
            stream.push(exc)
