"""What /v1/completions and /v1/chat/completions share: ids, envelopes, draining, usage."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import orjson
from starlette.responses import Response

from nanoserve.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream, RequestUpdate
from nanoserve.engine.outputs import PromptLogprobs
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.errors import APIError
from nanoserve.server.logprobs import TOKEN_ID_NAMES, TokenIdNames, TokenTexts
from nanoserve.server.metrics import RequestTimer
from nanoserve.server.prompt_logprobs import prompt_logprobs_json
from nanoserve.server.state import ServerState, engine_error, new_id, off_the_loop_if_long, timed, usage
from nanoserve.server.wire import DONE, sse_event, whole_json_response

logger = logging.getLogger(__name__)

# (update, its token ids and logprobs since the choice's last chunk) -> the chunk's choice, or None
# when the update shows nothing yet (its tokens and logprobs then wait for the choice's next chunk)
RenderChoice = Callable[[RequestUpdate, list[int], list], dict | None]


# a client's id is sent back in every chunk and written in the log line: uuids and trace ids fit
MAX_REQUEST_ID_CHARS = 256
# an SSE event this large took ~1 ms or more to build: the event loop gets a turn after it
LARGE_EVENT_BYTES = 64 * 1024


def client_request_id(header: str | None, field: str | None) -> str | None:
    """The id a client gave its request, as vLLM takes it: the X-Request-Id header, else the
    `request_id` field; None (a random id) when neither is given or both are empty."""
    for given, name in ((header, "The X-Request-Id header"), (field, "'request_id'")):
        if not given:
            continue
        if len(given) > MAX_REQUEST_ID_CHARS:
            raise APIError(f"{name} has {len(given)} characters; at most {MAX_REQUEST_ID_CHARS}",
                           param="request_id", code="invalid_value")
        if not given.isprintable():   # a newline would forge lines of the server's log
            raise APIError(f"{name} may hold printable characters only, not control characters or line breaks",
                           param="request_id", code="invalid_value")
        return given
    return None


def with_prompt_logprobs(params: SamplingParams, returned: int | None, echoed: int | None = None) -> SamplingParams:
    """`params` asking the engine for the prompt logprobs a response shows: `returned` alternatives
    in vLLM's prompt_logprobs, `echoed` in the logprobs of an echoed prompt."""
    asks = [n for n in (returned, echoed) if n is not None]
    return dataclasses.replace(params, prompt_logprobs=max(asks)) if asks else params


class OpenAIResponse:
    """One request between validation and its last byte. Subclasses name their object types.

    `id` is what the client sees ("cmpl-" and its own request id, as vLLM answers, or a random
    one); `engine_id` names the request in the engine, unique even when clients reuse an id."""

    id_prefix = ""
    body_object = ""   # "text_completion" / "chat.completion"
    chunk_object = ""  # the object of each SSE chunk

    def __init__(self, state: ServerState, req, model: str, client_id: str | None = None) -> None:
        self.state, self.req, self.model = state, req, model
        self.created = int(time.time())
        if client_id is None:
            self.id = self.engine_id = new_id(self.id_prefix)
        else:
            # two requests in flight under one id (a retry, a fixed id) must not meet in the
            # engine, where an id names the sequence to abort: its own random suffix tells them apart
            self.id = f"{self.id_prefix}-{client_id}"
            self.engine_id = f"{self.id}~{uuid.uuid4().hex}"
        self.cached: dict[int, int] = {}  # choice index -> its prompt tokens found in the prefix cache
        self.prompt_lens: list[int] = []  # token counts of the request's prompts, set by the endpoint

    @property
    def token_names(self) -> TokenTexts | TokenIdNames:
        """What logprobs call each token: its text, or "token_id:N" when the request asks."""
        by_id = self.req.return_tokens_as_token_ids
        if by_id is None:
            by_id = self.state.settings.return_tokens_as_token_ids
        return TOKEN_ID_NAMES if by_id else self.state.texts

    def envelope(self, object_: str) -> dict:
        """The fields every response and chunk starts with, before its choices."""
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    async def whole(self, choices: AsyncIterator[bytes], tail: dict) -> Response:
        """A whole response: the envelope, its choices written one at a time, then `tail`'s fields."""
        return await whole_json_response(self.envelope(self.body_object), choices, tail)

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {**self.envelope(self.chunk_object), "choices": choices}
        if self.req.include_usage:
            body["usage"] = usage
        return body

    def prompt_fields(self) -> dict:
        """Fields about the prompt beside the choices: in a whole response, and in a stream's first
        chunk (chat's prompt_token_ids; /v1/completions puts them in each choice)."""
        return {}

    async def drain(self, stream: RequestStream, timer: RequestTimer) -> None:
        """Read every update of a whole-response request; the texts accumulate in stream.outputs."""
        try:
            async for update in timed(stream, timer):
                self.cached[update.index] = update.num_cached_tokens
        except (EngineDeadError, RequestFailedError) as exc:
            raise engine_error(exc) from None
        finally:
            stream.close()

    async def prompt_logprobs_json(self, prompt: list[int], scored: PromptLogprobs | None) -> orjson.Fragment | None:
        """vLLM's prompt_logprobs of one prompt as JSON, built once however many choices carry it.

        A 4k-token prompt with 20 alternatives makes 86k entries (0.15 s, 5 MB): so many are built on a
        worker thread, where the event loop still gets its turns to serve other streams."""
        if not self.req.returns_prompt_logprobs or scored is None:
            return None
        top_n = self.req.prompt_logprobs

        def build() -> orjson.Fragment:
            return orjson.Fragment(prompt_logprobs_json(self.state.texts, prompt, scored, top_n))

        return await off_the_loop_if_long(len(prompt) * (top_n + 1), build)

    @staticmethod
    async def serialized(choice: dict) -> bytes:
        """A choice of a whole response as JSON, written now, then a pause for the event loop: 128
        choices with 2k echoed tokens of logprobs each, built and written at once, held every
        other request for 1.5 s."""
        written = orjson.dumps(choice)
        await asyncio.sleep(0)
        return written

    def usage(self, stream: RequestStream) -> dict:
        return usage(stream, self.req.n, self.prompt_lens, self.cached)

    async def sse(self, stream: RequestStream, timer: RequestTimer, opening: list[dict],
                  render: RenderChoice) -> AsyncIterator[bytes]:
        """The SSE body: an opening chunk, a chunk per update that shows something, usage, [DONE].

        An update with no text yet (half a character, a possible stop string) shows nothing: its
        tokens and logprobs wait for the next chunk of their choice."""
        pending: dict[int, tuple[list, list]] = {}
        try:
            if opening and not self.req.continuous_usage:
                yield sse_event({**self.chunk(opening), **self.prompt_fields()})
                opening = []
            async for u in timed(stream, timer):
                self.cached[u.index] = u.num_cached_tokens
                if opening:
                    # with continuous usage every chunk has it, the opening one too (0 completion
                    # tokens): sent with the first update, once the prompt's cached tokens are known,
                    # so that no chunk says 0 and the next 16
                    shown = self.usage(stream)   # the role only: no completion tokens yet
                    shown.update(completion_tokens=0, total_tokens=shown["prompt_tokens"])
                    yield sse_event({**self.chunk(opening, shown), **self.prompt_fields()})
                    opening = []
                ids, lps = pending.setdefault(u.index, ([], []))
                ids.extend(u.token_ids)
                lps.extend(u.logprobs or [])
                if not u.text and u.finish_reason is None:
                    continue
                choice = render(u, ids, lps)
                if choice is None:
                    continue
                del pending[u.index]
                event = sse_event(self.chunk([choice], self.usage(stream) if self.req.continuous_usage else None))
                yield event
                if len(event) > LARGE_EVENT_BYTES:
                    # queued updates pass without a pause: 128 choices each opening with 2k echoed
                    # tokens of logprobs, built back to back, held every other stream for 6.5 s
                    await asyncio.sleep(0)
            if self.req.include_usage:
                yield sse_event(self.chunk([], self.usage(stream)))
        except (EngineDeadError, RequestFailedError) as exc:
            yield sse_event(engine_error(exc).body())
        except Exception:   # a fault of this server's, past the status line: the client still learns of it
            logger.exception("stream %s failed", self.id)
            yield sse_event(APIError("The server failed while writing this stream; its log has the cause",
                                     500, code="internal_error").body())
        finally:
            stream.close()
        yield DONE
