"""One request's outputs on the front end: detokenized as steps arrive, merged while the reader lags."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from nanoserve.engine.messages import PromptTokenLogprob, StepOutput, TokenLogprob
from nanoserve.engine.outputs import CompletionOutput, RequestState


class EngineDeadError(RuntimeError):
    """The engine core stopped (an internal error or shutdown); no request can be served."""


class RequestFailedError(RuntimeError):
    """This request alone could not be served; the engine goes on serving the others."""


@dataclass(slots=True)
class RequestUpdate:
    """What one or more engine steps added to one of the n choices of a request."""

    index: int                              # which choice: p * n + i for the i-th of prompt p
    text: str                               # new text that is safe to show (may be empty)
    token_ids: list[int]                    # new tokens
    logprobs: list[TokenLogprob] | None     # one entry per new token when logprobs were asked for
    finish_reason: str | None               # "stop" or "length" on the choice's last update
    num_prompt_tokens: int
    num_cached_tokens: int                  # prompt tokens found in the prefix cache
    prompt_logprobs: list[PromptTokenLogprob | None] | None = None  # with the first update, when asked for
    stop_reason: str | int | None = None    # with a "stop": the stop string or stop token id, None for EOS

    def merge(self, later: RequestUpdate) -> None:
        """Fold a later update of the same choice into this one, as if both had come at once."""
        self.text += later.text
        self.token_ids += later.token_ids
        if later.logprobs:
            if self.logprobs is None:
                self.logprobs = later.logprobs
            else:
                self.logprobs += later.logprobs
        self.finish_reason = later.finish_reason or self.finish_reason
        self.stop_reason = later.stop_reason if later.stop_reason is not None else self.stop_reason
        self.num_cached_tokens = later.num_cached_tokens
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs


class RequestStream:
    """The outputs of one request (every choice of every prompt) as an async iterator of RequestUpdate.

    The engine client feeds it with `on_step` as steps arrive. Updates a slow reader has not taken
    yet merge into one per choice, so a lagging client costs one pending update per choice, not a
    queue that grows with every token. `close()` aborts whatever has not finished; call it when the
    consumer goes away. `outputs` holds each choice's whole text and tokens so far.
    """

    def __init__(self, request_ids: list[str], states: list[RequestState],
                 abort: Callable[[list[str]], None]) -> None:
        self.request_ids = request_ids
        self._states = dict(zip(request_ids, states))
        self._unfinished = set(request_ids)
        self._abort = abort
        self._pending: dict[int, RequestUpdate] = {}
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()
        self.outputs: list[CompletionOutput] = [state.output for state in states]
        self.closed = False

    def __aiter__(self) -> AsyncIterator[RequestUpdate]:
        return self._updates()

    async def _updates(self) -> AsyncIterator[RequestUpdate]:
        try:
            while True:
                if self._pending:
                    pending, self._pending = self._pending, {}
                    for update in pending.values():
                        yield update
                    continue
                if self._error is not None:
                    raise self._error
                if not self._unfinished:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
        finally:
            self.close()

    def on_step(self, step: StepOutput) -> bool:
        """Apply one engine output; True when the choice is done on this side (finished or stopped).

        A stop string ends a choice that the engine is still generating: its caller aborts it."""
        if step.request_id not in self._unfinished:
            return False  # steps already in flight when a stop string ended the choice
        out = self._states[step.request_id].update(step)
        update = RequestUpdate(out.index, out.text_delta, step.new_token_ids, step.logprobs, out.finish_reason,
                               step.num_prompt_tokens, step.num_cached_tokens, step.prompt_logprobs,
                               out.stop_reason)
        earlier = self._pending.get(out.index)
        if earlier is None:
            self._pending[out.index] = update
        else:
            earlier.merge(update)
        self._wakeup.set()
        if out.finished:
            self._unfinished.discard(step.request_id)
        return out.finished

    def fail(self, exc: BaseException) -> None:
        """End the stream with `exc` once the updates already here are read."""
        if self._error is None:
            self._error = exc
        self._wakeup.set()

    def close(self) -> None:
        """Abort the unfinished choices and take no more outputs. Idempotent."""
        if self.closed:
            return
        self.closed = True
        # ids are in choice order, so each prompt's first request is aborted before its siblings:
        # aborting it releases those that still wait to fork from it
        unfinished = [rid for rid in self.request_ids if rid in self._unfinished]
        self._unfinished.clear()
        self._abort(unfinished)
