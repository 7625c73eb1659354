"""POST /v1/completions: prompts as text or token ids, whole responses or SSE chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import Response

from nanoserve.engine.async_engine import RequestStream, RequestUpdate
from nanoserve.sampling_params import max_tokens_in_context
from nanoserve.server.errors import APIError
from nanoserve.server.logprobs import TextOffsets, completion_logprobs
from nanoserve.server.metrics import RequestTimer
from nanoserve.server.protocol import CompletionRequest
from nanoserve.server.response import OpenAIResponse, client_request_id, with_prompt_logprobs
from nanoserve.server.state import ServerState, off_the_loop_if_long, sampling_error, texts_length
from nanoserve.server.structured import constrain, requested_spec
from nanoserve.server.wire import cancel_on_disconnect, parse_body, sse_response

router = APIRouter()


class Completion(OpenAIResponse):
    """One /v1/completions request between validation and its last byte."""

    id_prefix, body_object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, state: ServerState, req: CompletionRequest, model: str, client_id: str | None = None) -> None:
        super().__init__(state, req, model, client_id)
        prompt = prompt_list(req.prompt)
        if not prompt:
            raise APIError("'prompt' is an empty list; give at least one prompt", param="prompt")
        self.prompts = [self._tokenized(p) if isinstance(p, str) else req.truncate(list(p)) for p in prompt]
        self.prompt_lens = [len(p) for p in self.prompts]
        # decoded here, where a long request is prepared off the event loop: a stream's first chunk
        # holds every echo, and 256 prompts of 2,000 ids decoded for it held the loop for 133 ms
        self.echoes = [self._echoed(given, ids) for given, ids in zip(prompt, self.prompts)] if req.echo else []

    def _tokenized(self, text: str) -> list[int]:
        ids = self.req.truncate(self.state.tokenizer.encode(self._bounded(text),
                                                            add_special_tokens=self.req.add_special_tokens))
        # refused at once rather than once every prompt is tokenized: 256 texts of 120 KB, each too
        # long for the context, took 13 s of tokenizing to be refused
        self.state.check_prompt_length(len(ids))
        return ids

    def _bounded(self, text: str) -> str:
        """The text to tokenize: refused when it cannot fit the context, cut when only its end is kept."""
        size, keep = self.state.prompt_size, self.req.truncate_prompt_tokens
        if keep is None:
            size.check(len(text), "prompt")
            return text
        return size.tail(text, keep)

    def _echoed(self, given: str | list[int], ids: list[int]) -> str:
        """A prompt as echo repeats it: a text as given; token ids (checked first: the tokenizer
        raises OverflowError past 32 bits) and truncated texts decoded."""
        if isinstance(given, str) and self.req.truncate_prompt_tokens is None:
            return given
        self.state.check_token_ids(ids, "prompt")
        return self.state.tokenizer.decode(ids)

    def echo(self, choice: int) -> str:
        """The prompt of a choice as echo repeats it; "" without echo."""
        return self.echoes[choice // self.req.n] if self.req.echo else ""

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo (how scoring harnesses ask for a prompt's logprobs): the engine
        still computes one token, and the response leaves it out."""
        return self.req.echo and self.req.max_tokens == 0

    def answer(self, text: str, ids: list[int], lps: list, finish_reason: str | None,
               stop_reason: str | int | None) -> tuple[str, list[int], list, str | None, str | int | None]:
        """A choice's own text, tokens, logprobs and finish; with echo_only, nothing of the one
        token computed, and "length" once it is done."""
        if self.echo_only:
            return "", [], [], "length" if finish_reason else None, None
        return text, ids, lps, finish_reason, stop_reason

    def usage(self, stream: RequestStream) -> dict:
        counted = super().usage(stream)
        if self.echo_only:
            counted.update(completion_tokens=0, total_tokens=counted["prompt_tokens"])
        return counted

    @property
    def scores_prompt(self) -> bool:
        """echo with logprobs: the echoed prompt carries its own tokens' logprobs."""
        return self.req.echo and self.req.logprobs is not None

    def echoed_tokens(self, choice: int, stream: RequestStream) -> tuple[list[int], list]:
        """Prompt token ids and logprobs that lead a choice's logprobs when the prompt is scored.
        The engine scores a prompt once, for its first choice, which has produced a token (and
        so its prompt's logprobs) before any of its siblings starts."""
        if not self.scores_prompt:
            return [], []
        p = choice // self.req.n
        scored = stream.outputs[p * self.req.n].prompt_logprobs
        # the engine may have scored more alternatives, for prompt_logprobs: echo shows `logprobs`
        return self.prompts[p], [] if scored is None else scored.entries(self.req.logprobs)

    def token_ids(self, choice: int, own_ids: list[int], first: bool) -> dict:
        """vLLM's return_token_ids: a choice's own new token ids (echo or not), and with its first
        chunk (or its whole body) the ids of its prompt."""
        if not self.req.return_token_ids:
            return {}
        fields = {"prompt_token_ids": self.prompts[choice // self.req.n]} if first else {}
        return {**fields, "token_ids": own_ids}

    def text_offsets(self, choice: int) -> TextOffsets:
        """Where a choice's tokens start in its text: a scored prompt's offsets count from its own
        start, a choice's own tokens from the end of an echo without logprobs."""
        start = 0 if self.scores_prompt else len(self.echo(choice))
        return TextOffsets(self.state.texts, self.req.skip_special_tokens, start)

    async def collect(self, stream: RequestStream, timer: RequestTimer) -> Response:
        await self.drain(stream, timer)
        return await self.whole(self.choices(stream), {"usage": self.usage(stream)})

    async def choices(self, stream: RequestStream) -> AsyncIterator[bytes]:
        """Each choice of a whole response as JSON, written when its turn comes to be sent."""
        n = self.req.n
        scored = None   # vLLM's prompt_logprobs: a prompt's, scored once with its first choice, for its n choices
        for c, out in enumerate(stream.outputs):
            if self.req.returns_prompt_logprobs and c % n == 0:
                p = c // n
                scored = await self.prompt_logprobs_json(self.prompts[p], stream.outputs[p * n].prompt_logprobs)
            prefix = self.echo(c)
            text, own_ids, own_lps, finish_reason, stop_reason = self.answer(
                out.text, out.token_ids, out.logprobs or [], out.finish_reason, out.stop_reason)
            logprobs = None
            if self.req.logprobs is not None:
                ids, lps = self.echoed_tokens(c, stream)
                logprobs = completion_logprobs(self.token_names, ids + own_ids, lps + own_lps,
                                               self.text_offsets(c), num_prompt_tokens=len(ids))
            yield await self.serialized({"index": c, "text": prefix + text, "logprobs": logprobs,
                                         "finish_reason": finish_reason, "stop_reason": stop_reason,
                                         **self.token_ids(c, own_ids, first=True),
                                         **({"prompt_logprobs": scored} if self.req.returns_prompt_logprobs else {})})

    def events(self, stream: RequestStream, timer: RequestTimer) -> AsyncIterator[bytes]:
        offsets = [self.text_offsets(c) for c in range(len(stream.outputs))]
        echoed: set[int] = set()
        opened: set[int] = set()   # choices whose first chunk has gone (with their prompt's token ids)

        def render(u: RequestUpdate, ids: list[int], lps: list) -> dict:
            text, own_ids, lps, finish_reason, stop_reason = self.answer(u.text, ids, lps, u.finish_reason,
                                                                         u.stop_reason)
            ids, num_prompt_tokens = own_ids, 0
            if self.scores_prompt and u.index not in echoed:
                # a prompt's logprobs exist once it is computed, so it is echoed with the first tokens
                echoed.add(u.index)
                prompt_ids, prompt_lps = self.echoed_tokens(u.index, stream)
                text, ids, lps = self.echo(u.index) + text, prompt_ids + ids, prompt_lps + lps
                num_prompt_tokens = len(prompt_ids)
            logprobs = None
            if self.req.logprobs is not None:
                logprobs = completion_logprobs(self.token_names, ids, lps, offsets[u.index], num_prompt_tokens)
            first = u.index not in opened
            opened.add(u.index)
            return {"index": u.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": stop_reason, **self.token_ids(u.index, own_ids, first)}

        opening = []
        if self.req.echo and not self.scores_prompt:
            opened.update(range(len(stream.outputs)))
            opening = [{"index": c, "text": self.echo(c), "logprobs": None, "finish_reason": None, "stop_reason": None,
                        **self.token_ids(c, [], first=True)} for c in range(len(stream.outputs))]
        return self.sse(stream, timer, opening, render)


def prompt_list(prompt: str | list) -> list:
    """The prompt field as a list of prompts: one text or one list of ids is a single prompt."""
    return [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt


def ids_length(prompt: str | list) -> int:
    """Token ids in a prompt field (text has none)."""
    return sum(len(p) for p in prompt_list(prompt) if not isinstance(p, str))


def refuse_unsupported(req: CompletionRequest, policy: str) -> None:
    if req.suffix:   # an empty suffix asks for nothing
        raise APIError("'suffix' is not supported by this server (no fill-in-the-middle)", param="suffix",
                       code="unsupported_parameter")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(f"best_of ({req.best_of}) must equal n ({req.n}): this server returns every completion it "
                       "generates and does not rank extra ones", param="best_of", code="unsupported_parameter")
    if req.max_tokens == 0 and not req.echo:
        raise APIError("max_tokens must be at least 1; 0 is allowed with echo, which returns the prompt alone "
                       "(with its logprobs when logprobs is set)", param="max_tokens")
    req.check_stream_options()
    req.check_priority(policy)


# what the OpenAI API and vLLM generate when a completion request gives no max_tokens
DEFAULT_MAX_TOKENS = 16


def default_max_tokens(state: ServerState, req: CompletionRequest, prompt_lens: list[int]) -> int:
    """The request's max_tokens, else 16 or whatever less the context leaves the longest prompt."""
    if req.max_tokens is not None:
        return req.max_tokens
    if (req.min_tokens or 0) > DEFAULT_MAX_TOKENS:
        raise APIError(f"min_tokens ({req.min_tokens}) is more than the {DEFAULT_MAX_TOKENS} tokens a completion "
                       "generates when max_tokens is not given: set max_tokens too", param="min_tokens")
    room = max_tokens_in_context(DEFAULT_MAX_TOKENS, max(prompt_lens), state.engine.config.max_model_len)
    return max(1, room)  # no room at all: the prompt check names the problem


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    timer = state.metrics.timer()  # latencies count from arrival, tokenizing included
    req = await parse_body(request, CompletionRequest)
    model = state.model_name(req.model)
    refuse_unsupported(req, state.engine.config.scheduling_policy)
    req.fit_truncation(state.engine.config.max_model_len)
    state.check_logprobs(req)
    if state.settings.force_include_usage:
        req.force_usage()
    state.settings.limits.check_request(len(prompt_list(req.prompt)), req.n, req.stop, req.stop_token_ids)
    client_id = client_request_id(request.headers.get("x-request-id"), req.request_id)
    # preparing the prompts tokenizes their text and, for echo, decodes their ids (~4 characters each)
    work = texts_length(req.prompt) + (4 * ids_length(req.prompt) if req.echo else 0)
    completion = await off_the_loop_if_long(work, Completion, state, req, model, client_id)
    try:
        # echo with max_tokens 0 computes one token, which the response leaves out
        params = req.sampling_params(max(1, default_max_tokens(state, req, completion.prompt_lens)), req.logprobs,
                                     state.sampling_defaults)
        params = with_prompt_logprobs(params, req.prompt_logprobs if req.returns_prompt_logprobs else None,
                                      req.logprobs if completion.scores_prompt else None)
    except ValueError as exc:
        raise sampling_error(exc) from None
    params = await constrain(state.specs, params, requested_spec(req), request)
    stream = await state.start(completion.engine_id, completion.prompts, params, streamed=req.stream,
                               priority=req.priority)
    state.budget.watch(request.scope, stream, completion.id)
    timer.request_id = completion.id
    timer.prompt(completion.prompt_lens, req.n, params.max_tokens, state.engine.config.max_model_len)
    if req.stream:
        return sse_response(completion.events(stream, timer), stream.close)
    body = await cancel_on_disconnect(request, completion.collect(stream, timer))
    return body if body is not None else Response(status_code=499)
