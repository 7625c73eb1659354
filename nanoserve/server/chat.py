"""POST /v1/chat/completions: messages rendered with the model's chat template, then generated."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import jinja2
from fastapi import APIRouter, Request
from starlette.responses import Response
from transformers import PreTrainedTokenizerBase

from nanoserve.engine.async_engine import RequestStream, RequestUpdate
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.errors import APIError
from nanoserve.server.logprobs import chat_logprobs
from nanoserve.server.metrics import RequestTimer
from nanoserve.server.chat_output import ChoiceReader
from nanoserve.server.conversation import template_inputs
from nanoserve.server.chat_protocol import ChatCompletionRequest, ChatMessage, Tool
from nanoserve.server.reasoning import REASONING_PARSERS
from nanoserve.server.response import OpenAIResponse, client_request_id, with_prompt_logprobs
from nanoserve.server.state import ServerState, off_the_loop_if_long, sampling_error
from nanoserve.server.structured import constrain, requested_spec
from nanoserve.server.tools import ToolPlan, plan_tools
from nanoserve.server.wire import cancel_on_disconnect, parse_body, sse_response

router = APIRouter()


def messages_length(messages: list[ChatMessage]) -> int:
    """Characters of what the messages give the prompt: text, names and tool calls."""
    return sum(len(m.text()) + len(m.name or "")
               + sum(len(c.function.name) + len(c.function.arguments) for c in m.tool_calls or ())
               for m in messages)


def template_tail(tokenizer, prompt: list[int], tags: tuple[str, ...]) -> str:
    """The text of the prompt after its last special token (the reasoning `tags` aside, should a
    tokenizer list them as special): the last message's header and what follows it (the generation
    prompt, or the message it continues, however long), never a "<think>" that a user wrote in a
    message before it."""
    special = set(tokenizer.all_special_ids) - set(tokenizer.convert_tokens_to_ids(list(tags)))
    last = len(prompt) - 1
    while last >= 0 and prompt[last] not in special:   # from the end: the last message's length at most
        last -= 1
    return tokenizer.decode(prompt[last + 1:])


def single_token_id(tokenizer: PreTrainedTokenizerBase, text: str) -> int | None:
    """The id of the one token that is this text, or None where the tokenizer has none."""
    token_id = tokenizer.convert_tokens_to_ids(text)
    if token_id is None or token_id == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(token_id) != text:
        return None
    return token_id


def check_continuation(continue_final_message: bool, add_generation_prompt: bool) -> None:
    if continue_final_message and add_generation_prompt:
        raise APIError("continue_final_message continues the last message, so add_generation_prompt must be "
                       "false: a new assistant header would close it", param="continue_final_message")


def render_chat(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                tools: list[Tool] | None = None, template_kwargs: dict | None = None,
                continue_final_message: bool = False, add_special_tokens: bool = False,
                documents: list[dict[str, str]] | None = None, keep_tokens: int | None = None) -> list[int]:
    """Token ids of the conversation as the model's chat template writes it; `keep_tokens`
    (truncate_prompt_tokens): only its last ones are wanted. A pass over every message: call it
    off the event loop for a large request."""
    tok = state.tokenizer
    size = state.prompt_size
    # the template only adds text: contents past the bound cannot fit once rendered either, unless
    # only the end is kept (as /v1/completions keeps a long text's end: the body bounds the render)
    if keep_tokens is None:
        size.check(messages_length(messages), "messages")
        if len(messages) > state.engine.config.max_model_len:   # each renders to a header at least
            raise APIError(f"The conversation has {len(messages)} messages: more than the "
                           f"{state.engine.config.max_model_len} tokens of the context (max_model_len) can hold",
                           param="messages", code="context_length_exceeded")
    if not tok.chat_template:
        raise APIError("This model has no chat template, so it cannot serve /v1/chat/completions; "
                       "use /v1/completions with a prompt instead", param="messages")
    conversation, extra = template_inputs(messages, tools, template_kwargs, documents)
    if "developer" not in tok.chat_template:
        # OpenAI's developer messages are its system messages; a template that does not know the
        # role would write it verbatim, a header the model never saw in training
        conversation = [{**m, "role": "system"} if m["role"] == "developer" else m for m in conversation]
    try:
        text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False,
                                       continue_final_message=continue_final_message, **extra)
    except jinja2.TemplateSyntaxError as exc:   # the server's template is broken, whatever the messages
        raise APIError(f"The server's chat template does not compile ({exc}); chat requests fail until the server "
                       "is given a working one with --chat-template", 500, code="chat_template_error") from None
    except (jinja2.TemplateError, TypeError, ValueError) as exc:  # e.g. "roles must alternate user/assistant"
        raise APIError(f"The chat template refused these messages: {exc}", param="messages") from None
    if keep_tokens is not None:   # its end alone is tokenized, as a long completion prompt's is
        text = size.tail(text, keep_tokens)
    else:
        # tools and reasoning are written by the template but not counted above: 25 MB of a
        # tool's description took 40 s and 3.6 GB to tokenize before the token count refused it
        size.check(len(text), "messages", "conversation as the chat template writes it (tools and "
                   "reasoning included)")
    # by default none: the template already wrote every special token the model expects (BOS included)
    return tok.encode(text, add_special_tokens=add_special_tokens)


def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """The request's prompt: its conversation as the chat template writes it, truncated as it asks.
    A pass over every message: call it off the event loop for a large request."""
    kwargs = req.chat_template_kwargs
    if req.reasoning_effort is not None:   # the request's field, unless the kwargs set it
        kwargs = {"reasoning_effort": req.reasoning_effort, **(kwargs or {})}
    return req.truncate(render_chat(state, req.messages, req.add_generation_prompt, req.tools, kwargs,
                                    req.continue_final_message, req.add_special_tokens, req.documents,
                                    req.truncate_prompt_tokens))


class ChatCompletion(OpenAIResponse):
    """One /v1/chat/completions request between validation and its last byte."""

    id_prefix, body_object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, state: ServerState, req: ChatCompletionRequest, model: str, tools: ToolPlan,
                 client_id: str | None = None) -> None:
        super().__init__(state, req, model, client_id)
        self.prompt = chat_prompt(state, req)
        self.prompt_lens = [len(self.prompt)]
        self.top_n = req.top_logprobs or 0
        parser = REASONING_PARSERS.get(state.settings.reasoning_parser)
        # a template may open the reasoning for the model, or write it closed (thinking turned off)
        tail = template_tail(state.tokenizer, self.prompt, (parser.START, parser.END)) if parser else ""
        opened = parser is not None and parser.opens_in(tail)
        self.readers = [ChoiceReader(tools, parser(opened) if parser else None, req.include_reasoning)
                        for _ in range(req.n)]
        # a grammar waits for the reasoning's end, unless the prompt has ended it
        self.reasoning = (parser, opened) if parser and not parser.closes_in(tail) else None
        # as vLLM answers: as --response-role (the assistant), or without a generation prompt as the last
        # message's author
        last = req.messages[-1]
        self.role = state.settings.response_role if req.add_generation_prompt else last.role
        # vLLM's echo: a reply that continues a message of its own author repeats that message first
        self.echoed = last.text() if req.echo and last.role == self.role else ""

    def after_reasoning(self, params: SamplingParams) -> SamplingParams:
        """`params` whose grammar (response_format, a required or named tool) holds only after the
        reasoning, as vLLM's structured outputs do with a reasoning parser: the model thinks freely,
        then answers to the grammar. Where the tokenizer has no single token for each tag, the
        grammar holds from the first token."""
        spec = params.structured_outputs
        if spec is None or self.reasoning is None:
            return params
        parser, opened = self.reasoning
        start, end = (single_token_id(self.state.tokenizer, tag) for tag in (parser.START, parser.END))
        if end is None:
            return params
        spec = dataclasses.replace(spec, reasoning_start_id=start, reasoning_end_id=end, reasoning_open=opened)
        return dataclasses.replace(params, structured_outputs=spec)

    def logprobs(self, token_ids: list[int], logprobs: list | None) -> dict | None:
        return chat_logprobs(self.token_names, token_ids, logprobs or [], self.top_n) if self.req.logprobs else None

    def token_ids(self, token_ids: list[int]) -> dict:
        """vLLM's return_token_ids: a choice's new token ids, before reasoning and tool calls are read."""
        return {"token_ids": token_ids} if self.req.return_token_ids else {}

    def prompt_fields(self) -> dict:
        # as vLLM sends them: the prompt's ids once, beside the choices (streamed: the first chunk's)
        return {"prompt_token_ids": self.prompt} if self.req.return_token_ids else {}

    async def collect(self, stream: RequestStream, timer: RequestTimer) -> Response:
        await self.drain(stream, timer)
        tail = {"usage": self.usage(stream), **self.prompt_fields()}
        if self.req.returns_prompt_logprobs:   # vLLM's: beside the choices, which share one prompt
            tail["prompt_logprobs"] = await self.prompt_logprobs_json(self.prompt, stream.outputs[0].prompt_logprobs)
        return await self.whole(self.choices(stream), tail)

    async def choices(self, stream: RequestStream) -> AsyncIterator[bytes]:
        """Each choice of a whole response as JSON, written when its turn comes to be sent."""
        for c, out in enumerate(stream.outputs):
            message, finish_reason = self.readers[c].message(out.text, out.finish_reason,
                                                             stop_string=isinstance(out.stop_reason, str))
            message["role"] = self.role
            if self.echoed:
                message["content"] = self.echoed + (message["content"] or "")
            logprobs = self.logprobs(out.token_ids, out.logprobs)
            yield await self.serialized({"index": c, "message": message, "logprobs": logprobs,
                                         "finish_reason": finish_reason, "stop_reason": out.stop_reason,
                                         **self.token_ids(out.token_ids)})

    def events(self, stream: RequestStream, timer: RequestTimer) -> AsyncIterator[bytes]:
        def render(u: RequestUpdate, ids: list[int], lps: list) -> dict | None:
            delta, finish_reason = self.readers[u.index].delta(u.text, u.finish_reason)
            if not delta and finish_reason is None:
                return None  # text a parser holds back (a tag, the start of a call) shows nothing yet
            return {"index": u.index, "delta": delta, "logprobs": self.logprobs(ids, lps),
                    "finish_reason": finish_reason, "stop_reason": u.stop_reason, **self.token_ids(ids)}

        # the role comes first, in a delta of its own for every choice, with what echo repeats
        opening = [{"index": c, "delta": {"role": self.role, "content": self.echoed}, "logprobs": None,
                    "finish_reason": None, "stop_reason": None} for c in range(len(stream.outputs))]
        return self.sse(stream, timer, opening, render)


def max_tokens(req: ChatCompletionRequest) -> int | None:
    """max_completion_tokens where given (the API's newer name), else max_tokens: a client that
    sends both gets the newer one, as vLLM gives it."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    timer = state.metrics.timer()  # latencies count from arrival, rendering and tokenizing included
    req = await parse_body(request, ChatCompletionRequest)
    chat, stream = await start_chat(request, state, req, timer)
    if req.stream:
        return sse_response(chat.events(stream, timer), stream.close)
    body = await cancel_on_disconnect(request, chat.collect(stream, timer))
    return body if body is not None else Response(status_code=499)


async def start_chat(request: Request, state: ServerState, req: ChatCompletionRequest,
                     timer: RequestTimer, text_chars: int | None = None) -> tuple[ChatCompletion, RequestStream]:
    """Check, render and start a chat request in the engine: the response's reader and its stream.
    `text_chars`: how much text the render may read, where the body's length does not bound it."""
    model = state.model_name(req.model)
    state.settings.limits.check_request(1, req.n, req.stop, req.stop_token_ids)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    check_continuation(req.continue_final_message, req.add_generation_prompt)
    req.check_stream_options()
    if state.settings.force_include_usage:
        req.force_usage()
    req.check_priority(state.engine.config.scheduling_policy)
    req.fit_truncation(state.engine.config.max_model_len)
    state.check_logprobs(req)
    try:
        params = req.sampling_params(max_tokens(req), (req.top_logprobs or 0) if req.logprobs else None,
                                     state.sampling_defaults)
        params = with_prompt_logprobs(params, req.prompt_logprobs if req.returns_prompt_logprobs else None)
    except ValueError as exc:
        raise sampling_error(exc) from None
    settings = state.settings
    tools = plan_tools(req, settings.tool_call_parser, settings.enable_auto_tool_choice)
    asked = ("tool_choice", tools.spec) if tools.spec is not None else requested_spec(req)
    params = await constrain(state.specs, params, asked, request)
    if tools.parser is not None and tools.parser.needs_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)  # its calls start with a special token
    client_id = client_request_id(request.headers.get("x-request-id"), req.request_id)
    # the body bounds what a render reads (text, tools, documents, template variables, a header a
    # message), so it says where to render without a pass over the messages on the event loop:
    # that pass alone took 20-35 ms at 16,384 messages of parts, or as many tools
    if text_chars is None:
        text_chars = len(await request.body())
    chat = await off_the_loop_if_long(text_chars, ChatCompletion, state, req, model, tools, client_id)
    params = chat.after_reasoning(params)
    try:
        stream = await state.start(chat.engine_id, [chat.prompt], params, streamed=req.stream, priority=req.priority)
    except APIError as exc:
        if exc.param == "max_tokens" and req.max_completion_tokens is not None:
            exc.param = "max_completion_tokens"   # the field this request set
        elif exc.param == "prompt":
            exc.param = "messages"   # the prompt a chat request has: its rendered messages
        raise
    timer.request_id = chat.id
    timer.prompt(chat.prompt_lens, req.n, params.max_tokens, state.engine.config.max_model_len)
    state.budget.watch(request.scope, stream, chat.id)
    return chat, stream
