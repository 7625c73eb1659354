"""POST /v1/responses: OpenAI's Responses API over the chat path (the same rendering, constraints
and tool calls), answered as output items (reasoning, a message, function calls): whole, or as
the API's typed events."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing

import orjson
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from transformers import PreTrainedTokenizerBase

from nanoserve.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from nanoserve.server.chat import ChatCompletion, chat_prompt, start_chat
from nanoserve.server.chat_output import whole_arguments
from nanoserve.server import reasoning_state
from nanoserve.server.errors import APIError
from nanoserve.server.metrics import RequestTimer
from nanoserve.server.chat_protocol import ChatCompletionRequest
from nanoserve.server.responses_protocol import ResponsesRequest, as_chat_request, in_responses_terms
from nanoserve.server.state import ServerState, engine_error, off_the_loop_if_long, timed
from nanoserve.server.wire import cancel_on_disconnect, json_response, parse_body, sse_response

logger = logging.getLogger(__name__)
router = APIRouter()


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _append(item: dict, key: str, text: str) -> None:
    """item[key] += text, in place: with no other reference CPython grows the string, where the
    `+=` on the item copied the whole of it for every delta (O(n^2) in the output's length)."""
    whole, item[key] = item[key], ""   # the key keeps its place in the item
    whole += text
    item[key] = whole


def reasoning_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """The tokens of a reasoning's text as the tokenizer writes it (the tags around it aside)."""
    return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0


def _typed_event(kind: str, fields: dict) -> bytes:
    # the event line names the type too, as OpenAI's API sends it (its client reads the data's)
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


class ResponseWriter:
    """One response's items and envelope, from the chat request that generates it."""

    sending = True   # the events are written (a stream), or only read for the items they make (whole)

    def __init__(self, state: ServerState, req: ResponsesRequest, chat: ChatCompletion) -> None:
        self.state, self.req, self.chat = state, req, chat
        # the client's request id, where it gave one, follows the prefix as in chat's id
        self.id = "resp_" + chat.id.split("-", 1)[1]
        self.items: list[dict] = []
        self.sequence = 0
        self.open: str | None = None   # the kind of the item still being written
        self.result: dict | None = None   # the response, once its last event is written

    def envelope(self, status: str, usage: dict | None, finish_reason: str | None = None) -> dict:
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        return {
            "id": self.id, "object": "response", "created_at": self.chat.created, "status": status,
            "background": False, "error": None, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.chat.model,
            "output": self.items, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "store": False, "temperature": req.temperature, "top_p": req.top_p,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "text": {"format": req.text.format.echoed() if req.text and req.text.format else {"type": "text"}},
            "tool_choice": (req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump")
                            else req.tool_choice or "auto"),
            "tools": req.tools or [], "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {}, "max_tool_calls": req.max_tool_calls, "top_logprobs": req.top_logprobs,
            "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier,
            "completed_at": int(time.time()) if status == "completed" else None,
        }

    async def usage(self, stream: RequestStream) -> dict:
        counts = self.chat.usage(stream)
        reasoning = "".join(item["content"][0]["text"] for item in self.items if item["type"] == "reasoning")
        # tokenized again: on the event loop, 590 KB of reasoning held every other stream for 0.38 s
        thought = await off_the_loop_if_long(len(reasoning), reasoning_tokens, self.state.tokenizer, reasoning)
        prompt, cached = counts["prompt_tokens"], counts["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": cached,
                                         "cache_write_tokens": self.cache_written(prompt, cached)},
                "output_tokens": counts["completion_tokens"], "output_tokens_details": {"reasoning_tokens": thought},
                "total_tokens": counts["total_tokens"]}

    def cache_written(self, prompt: int, cached: int) -> int:
        """Input tokens this response put in the prefix cache: its full blocks that were not there."""
        config = self.state.engine.config
        if not config.enable_prefix_caching:
            return 0
        return max(0, prompt // config.block_size * config.block_size - cached)

    @staticmethod
    def status(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    # items

    @staticmethod
    def reasoning_item(text: str, status: str) -> dict:
        return {"id": _new_id("rs"), "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}

    @staticmethod
    def message_item(text: str, logprobs: list, status: str) -> dict:
        return {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}

    @staticmethod
    def call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
        return {"id": _new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    async def collect(self, stream: RequestStream, timer: RequestTimer) -> Response:
        """The whole response: its stream, read to the end and not sent. Read whole apart from the
        stream, the message's logprobs were every generated token's (the reasoning's, the calls'),
        where the stream gives each with the text it shows; read this way the two cannot differ."""
        self.sending = False
        try:
            async with aclosing(self.written(stream, timer)) as events:
                async for _ in events:
                    pass
        except (EngineDeadError, RequestFailedError) as exc:
            raise engine_error(exc) from None
        finally:
            stream.close()
        return json_response(self.result)

    # items, as events

    def event(self, kind: str, **fields) -> bytes:
        self.sequence += 1
        if not self.sending:   # a whole response: the events change the items, and are not written
            return b""
        return _typed_event(kind, {**fields, "sequence_number": self.sequence - 1})

    def open_item(self, item: dict) -> list[bytes]:
        self.items.append(item)
        index = len(self.items) - 1
        if item["type"] == "function_call":
            return [self.event("response.output_item.added", output_index=index, item={**item, "status": "in_progress"})]
        # the item comes empty and its part in an event of its own, as OpenAI sends them: the SDK's
        # stream helper adds each part it is sent, and a part given twice made two of it
        events = [self.event("response.output_item.added", output_index=index,
                             item={**item, "status": "in_progress", "content": []})]
        part = {**item["content"][0], "text": ""}
        if "logprobs" in part:
            part["logprobs"] = []
        events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                 content_index=0, part=part))
        return events

    def close_item(self, status: str) -> list[bytes]:
        """The done events of the item opened last, which is whole now. A call is "completed" when
        its arguments are whole, whatever cut the response short (a later call, by max_output_tokens),
        and "incomplete" when they are not (a stop string or the end of the text inside them)."""
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = (status if item["type"] != "function_call" else
                          "completed" if whole_arguments(item["arguments"]) else "incomplete")
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            events = [self.event("response.function_call_arguments.done", **where, name=item["name"],
                                 arguments=item["arguments"])]
        else:
            part = item["content"][0]
            if item["type"] == "message":
                done = self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                  logprobs=part["logprobs"])
            else:
                done = self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
                if self.req.wants_reasoning_blobs:
                    item["encrypted_content"] = reasoning_state.pack(part["text"])
            events = [done, self.event("response.content_part.done", **where, content_index=0, part=part)]
        return events + [self.event("response.output_item.done", output_index=index, item=item)]

    def switch_to(self, kind: str, item: dict) -> list[bytes]:
        """Finish the open item, if any, and open `item` of this kind."""
        events = self.close_item("completed") if self.open is not None else []
        self.open = kind
        return events + self.open_item(item)

    def message_text(self, text: str, logprobs: list) -> list[bytes]:
        """Text (and its tokens' logprobs) for the message, opened here unless it is the open item."""
        events = [] if self.open == "message" else self.switch_to("message", self.message_item("", [], "in_progress"))
        part = self.items[-1]["content"][0]
        _append(part, "text", text)
        part["logprobs"] += logprobs
        events.append(self.event("response.output_text.delta", item_id=self.items[-1]["id"],
                                 output_index=len(self.items) - 1, content_index=0, delta=text, logprobs=logprobs))
        return events

    def apply(self, delta: dict, logprobs: list) -> list[bytes]:
        """Events for one chat delta: it may finish the open item and open the next."""
        events: list[bytes] = []
        if delta.get("reasoning"):
            if self.open != "reasoning":
                events += self.switch_to("reasoning", self.reasoning_item("", "in_progress"))
            part = self.items[-1]["content"][0]
            _append(part, "text", delta["reasoning"])
            events.append(self.event("response.reasoning_text.delta", item_id=self.items[-1]["id"],
                                     output_index=len(self.items) - 1, content_index=0, delta=delta["reasoning"]))
        if delta.get("content"):
            events += self.message_text(delta["content"], _own_entries(delta["content"], logprobs))
        for entry in delta.get("tool_calls") or ():
            if "id" in entry:   # a new call, announced by its name
                events += self.switch_to(f"call{entry['index']}", self.call_item(entry["id"], entry["function"]["name"],
                                                                                 "", "in_progress"))
            fragment = entry["function"].get("arguments")
            if fragment:
                _append(self.items[-1], "arguments", fragment)
                events.append(self.event("response.function_call_arguments.delta", item_id=self.items[-1]["id"],
                                         output_index=len(self.items) - 1, delta=fragment))
        return events

    def unshown_logprobs(self, entries: list) -> list[bytes]:
        """The last tokens' logprobs where they add no text (the end-of-sequence token, the token
        that completed a stop string), in a delta of "" as chat's last chunk carries them: the
        whole message has them, as a whole chat message does. Tokens after a reasoning or a call
        item belong to no message, whole or streamed."""
        if self.open != "message" and self.items:
            return []
        return self.message_text("", entries)   # nothing written yet: the empty answer is still a message

    async def written(self, stream: RequestStream, timer: RequestTimer) -> AsyncIterator[bytes]:
        """The response's events, created to completed; `result` is the response then. The engine's
        errors are raised."""
        reader = self.chat.readers[0]
        ids: list[int] = []
        lps: list = []
        finish_reason = None
        yield self.event("response.created", response=self.envelope("in_progress", None))
        yield self.event("response.in_progress", response=self.envelope("in_progress", None))
        async for u in timed(stream, timer):
            self.chat.cached[u.index] = u.num_cached_tokens
            ids.extend(u.token_ids)
            lps.extend(u.logprobs or [])
            if not u.text and u.finish_reason is None:
                continue
            delta, finish = reader.delta(u.text, u.finish_reason)
            finish_reason = finish or finish_reason
            if not delta and finish is None:
                continue   # held back by a parser (a tag, the start of a call)
            logprobs = self.chat.logprobs(ids, lps)
            entries = logprobs["content"] if logprobs else []
            events = self.apply(delta, entries)
            if finish is not None and entries and not delta.get("content"):
                events += self.unshown_logprobs(entries)
            for event in events:
                yield event
            ids, lps = [], []
        status = self.status(finish_reason)
        if self.open is not None:
            for event in self.close_item(status):
                yield event
        elif not self.items:   # nothing was written: an empty answer is still a message
            for event in self.open_item(self.message_item("", [], status)) + self.close_item(status):
                yield event
        self.result = self.envelope(status, await self.usage(stream), finish_reason)
        yield self.event("response.incomplete" if status == "incomplete" else "response.completed",
                         response=self.result)

    async def events(self, stream: RequestStream, timer: RequestTimer) -> AsyncIterator[bytes]:
        try:
            async with aclosing(self.written(stream, timer)) as events:
                async for event in events:
                    yield event
        except (EngineDeadError, RequestFailedError) as exc:
            for event in self.failed(engine_error(exc)):
                yield event
        except Exception:   # a fault of this server's, past the status line: the client still learns of it
            logger.exception("stream %s failed", self.id)
            for event in self.failed(APIError("The server failed while writing this stream; its log has the cause",
                                              500, code="internal_error")):
                yield event
        finally:
            stream.close()

    def failed(self, error: APIError) -> list[bytes]:
        """The error event, then the response as failed, as OpenAI's API ends a stream it cannot finish."""
        body = self.envelope("failed", None)
        body["error"] = {"code": error.code, "message": error.message}
        return [self.event("error", code=error.code, message=error.message, param=error.param),
                self.event("response.failed", response=body)]


async def _text_chars(request: Request, req: ResponsesRequest) -> int:
    """How much text reading the request may take: its body's length, and what its blobs may unpack
    to (a 43 kB blob unpacked to 32 MiB of reasoning in 0.17 s, to be rendered after)."""
    chars = len(await request.body())
    return chars + reasoning_state.MAX_UNPACKED_BYTES if req.replays_reasoning_blobs else chars


async def _as_chat(req: ResponsesRequest, text_chars: int) -> ChatCompletionRequest:
    # as long as the input: 240,000 items took 4 s to become a chat request
    return await off_the_loop_if_long(text_chars, as_chat_request, req)


@contextlib.contextmanager
def _named_as_responses() -> Iterator[None]:
    """Chat's checks name chat's fields: an error names the field of the Responses request that set it."""
    try:
        yield
    except APIError as exc:
        in_responses_terms(exc)
        raise


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    timer = state.metrics.timer()
    req = await parse_body(request, ResponsesRequest)
    text_chars = await _text_chars(request, req)
    with _named_as_responses():
        chat, stream = await start_chat(request, state, await _as_chat(req, text_chars), timer, text_chars)
    writer = ResponseWriter(state, req, chat)
    timer.request_id = writer.id   # the log line names the id the client sees
    if req.stream:
        return sse_response(writer.events(stream, timer), stream.close)
    body = await cancel_on_disconnect(request, writer.collect(stream, timer))
    return body if body is not None else Response(status_code=499)


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(request: Request) -> Response:
    """OpenAI's count of a request's input tokens: the prompt the same body would have on /v1/responses."""
    state: ServerState = request.app.state.server
    req = await parse_body(request, ResponsesRequest)
    with _named_as_responses():
        chat_request = await _as_chat(req, await _text_chars(request, req))
        state.model_name(chat_request.model)
        prompt = await run_in_threadpool(chat_prompt, state, chat_request)
    return json_response({"object": "response.input_tokens", "input_tokens": len(prompt)})


@router.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
@router.api_route("/v1/responses/{response_id}/{action}", methods=["GET", "POST"])
async def stored_response(response_id: str) -> Response:
    """Retrieve, delete, cancel, input_items: OpenAI's calls on a stored response, of which there are none."""
    raise APIError(f"No response found with id {response_id[:80]!r}: this server keeps no responses, so it "
                   "cannot retrieve, delete or cancel one", 404, param="response_id", code="not_found")


def _own_entries(text: str, entries: list) -> list:
    """The logprob entries of the tokens that wrote `text`, the last ones: tokens a parser held back
    before it (a reasoning's closing tag) came with it and belong to no message. All of them where
    the tokens' texts do not spell it (a character split across tokens)."""
    spelled = ""
    for start in range(len(entries) - 1, -1, -1):
        spelled = entries[start]["token"] + spelled
        if len(spelled) >= len(text):
            return entries[start:] if spelled == text else entries
    return entries
