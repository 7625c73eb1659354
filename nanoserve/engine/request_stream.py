"""One request's outputs on the front end: detokenized as steps arrive, merged while the reader lags."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from nanoserve.engine.messages import StepOutput, TokenLogprob
from nanoserve.engine.outputs import CompletionOutput, RequestState
from nanoserve.engine.prompt_logprobs import PromptLogprobs
from nanoserve.sampling_params import SamplingParams

# What a token's output holds in this process, by sys.getsizeof on CPython 3.12: its id (an int
# and a list slot); with logprobs a (float, list, rank) tuple, and per alternative an (int, float)
# tuple and its slot. Measured against the process: 600 tokens with 20 alternatives held ~2.7 KB each.
TOKEN_BYTES = 40
LOGPROB_BYTES = 172
ALTERNATIVE_BYTES = 116


def output_bytes_per_token(params: SamplingParams) -> int:
    """About what one generated token costs this process while its output is held."""
    if params.logprobs is None:
        return TOKEN_BYTES
    return TOKEN_BYTES + LOGPROB_BYTES + ALTERNATIVE_BYTES * params.logprobs


def prompt_logprobs_bytes(prompt_logprobs: PromptLogprobs | None) -> int:
    return 0 if prompt_logprobs is None else prompt_logprobs.nbytes


class EngineDeadError(RuntimeError):
    """The engine core stopped (an internal error or shutdown); no request can be served."""


class RequestFailedError(RuntimeError):
    """This request alone could not be served; the engine goes on serving the others. `own_fault`: what
    failed is the request's own content (a grammar past a bound), so the same request fails again."""

    def __init__(self, message: str, own_fault: bool = False) -> None:
        super().__init__(message)
        self.own_fault = own_fault


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
    prompt_logprobs: PromptLogprobs | None = None  # with the first update, when asked for
    stop_reason: str | int | None = None    # with a "stop": the stop string or stop token id, None for EOS
    # texts merged after `text`, joined once the update is read: `text +=` on each merge copied the
    # whole backlog again, O(n^2) for a reader that lags by thousands of tokens
    later_texts: list[str] = field(default_factory=list, repr=False)

    def merge(self, later: RequestUpdate) -> None:
        """Fold a later update of the same choice into this one, as if both had come at once (its
        text is joined when the stream yields it)."""
        if later.text:
            self.later_texts.append(later.text)
        self.token_ids += later.token_ids
        if later.logprobs:
            if self.logprobs is None:
                self.logprobs = later.logprobs
            else:
                self.logprobs += later.logprobs
        self.finish_reason = later.finish_reason or self.finish_reason
        self.stop_reason = later.stop_reason if later.stop_reason is not None else self.stop_reason
        self.num_cached_tokens = later.num_cached_tokens
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs


class RequestStream:
    """The outputs of one request (every choice of every prompt) as an async iterator of RequestUpdate.

    The engine client feeds it with `on_step` as steps arrive. Updates a slow reader has not taken
    yet merge into one per choice, so a lagging client costs one pending update per choice, not a
    queue that grows with every token (though that update grows: `pending_bytes` says by how much).
    `close()` aborts whatever has not finished; call it when the consumer goes away. `outputs`
    holds each choice's whole text and tokens so far, unless its states keep only counts (streams).
    """

    def __init__(self, request_ids: list[str], states: list[RequestState],
                 abort: Callable[[list[str]], None], interval: int = 1) -> None:
        self.request_ids = request_ids
        # wake the reader once a choice has this many new tokens (vLLM's --stream-interval): its first
        # and its last update come at once whatever it is, so neither TTFT nor the end waits
        self.interval = interval
        self._states = dict(zip(request_ids, states))
        self._unfinished = set(request_ids)
        self._abort = abort
        self._pending: dict[int, RequestUpdate] = {}
        self._params = states[0].params
        self._token_bytes = output_bytes_per_token(self._params)
        self._keeps = states[0].keep
        self.pending_bytes = 0   # about what the updates not read yet hold in memory
        self.kept_bytes = 0      # about what `outputs` hold (prompt logprobs only, for states that keep counts)
        self.timing: tuple[float, float] | None = None   # (queued, first run to first token) seconds, from the core
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()
        self.outputs: list[CompletionOutput] = [state.output for state in states]
        self.closed = False

    def __aiter__(self) -> AsyncIterator[RequestUpdate]:
        return self._updates()

    async def _updates(self) -> AsyncIterator[RequestUpdate]:
        try:
            while True:
                # pending updates wait for on_step's wake-up (a choice's interval of tokens), unless the
                # stream is over: the last ones are read whatever they hold
                if self._pending and (self._wakeup.is_set() or self._error is not None or not self._unfinished):
                    self._wakeup.clear()
                    pending, self._pending = self._pending, {}
                    self.pending_bytes = 0
                    for update in pending.values():
                        if update.later_texts:
                            update.text = "".join([update.text, *update.later_texts])
                            update.later_texts.clear()
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
        if step.timing is not None and (self.timing is None or step.timing[0] > self.timing[0]):
            self.timing = step.timing   # the choice that waited longest: the request waited as long
        update = RequestUpdate(out.index, out.text_delta, step.new_token_ids, step.logprobs, out.finish_reason,
                               step.num_prompt_tokens, step.num_cached_tokens, step.prompt_logprobs,
                               out.stop_reason)
        size = len(out.text_delta) + len(step.new_token_ids) * self._token_bytes
        scored = prompt_logprobs_bytes(step.prompt_logprobs)
        self.pending_bytes += size + scored
        # outputs keep a prompt's logprobs either way: an echo shows them with each of its n choices
        self.kept_bytes += scored + (size if self._keeps else 0)
        earlier = self._pending.get(out.index)
        if earlier is None:
            self._pending[out.index] = update
        else:
            earlier.merge(update)
            update = earlier
        if (self.interval == 1 or out.finished() or len(update.token_ids) >= self.interval
                or len(update.token_ids) == out.num_tokens):   # its first tokens: not held for TTFT
            self._wakeup.set()
        if out.finished():
            self._unfinished.discard(step.request_id)
        return out.finished()

    @property
    def engine_done(self) -> bool:
        """No choice is generating any more: each finished, was stopped, or was aborted."""
        return not self._unfinished

    def drop_pending(self) -> None:
        """Forget the updates not read yet (a request ended for holding too much)."""
        self._pending.clear()
        self.pending_bytes = 0

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
