"""The body of POST /v1/responses (OpenAI's Responses API, as vLLM serves it), and its translation
into the chat request that this server renders, constrains and generates.

This server keeps no responses: `previous_response_id`, `background` and `conversation` ask it to,
so they are refused by name; `store` is accepted and changes nothing. Function tools are served;
OpenAI's hosted tools (web search, file search, code interpreter, ...) run on OpenAI's side and
are refused by name. Sampling fields keep chat's bounds: they are chat's own field definitions.
"""

from __future__ import annotations

import copy
import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError

from nanoserve.sampling_params import MAX_INT
from nanoserve.server import reasoning_state
from nanoserve.server.errors import APIError, from_validation_error
from nanoserve.server.chat_protocol import ChatCompletionRequest, Parameters
from nanoserve.server.protocol import (MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOLS, Items, Metadata, MetadataValue,
                                       SafetyIdentifier, SamplingFields, Strict, StructuredOutputsRequest)


_LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _chat_field(name: str):
    """A chat request field's definition (type bounds included), for the field of the same meaning here."""
    return copy.deepcopy(SamplingFields.model_fields[name])


class InputText(Strict):
    """A text part of a message: the user's (input_text) or an earlier answer's (output_text)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None   # an earlier answer's, as the client replays it: unused
    logprobs: list[Any] | None = None


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: str


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[Items[InputText | Refusal], Field(max_length=MAX_CONTENT_PARTS)]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text if isinstance(p, InputText) else p.refusal for p in self.content)


class FunctionCallItem(Strict):
    """A call the model made earlier, replayed in the input."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    """What the client's function returned for a call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | Annotated[Items[InputText], Field(max_length=MAX_CONTENT_PARTS)]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


class ReasoningItem(Strict):
    """An earlier answer's reasoning, replayed: its text (its content, else a blob of this server's in
    encrypted_content, else its summary) goes back to the template with that answer."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: Items[dict[str, Any]] = Field([], max_length=MAX_CONTENT_PARTS)
    content: Items[dict[str, Any]] | None = Field(None, max_length=MAX_CONTENT_PARTS)
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str:
        parts = self.content or self.summary
        return "\n".join(p["text"] for p in parts if isinstance(p.get("text"), str))


_ITEM_KINDS = {"message": MessageItem, "function_call": FunctionCallItem,
               "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


def _item_kind(item: Any) -> str | None:
    """The class that reads an input item, by the item's type: a message when it names none (OpenAI's
    easy input message), and when it is no object at all (which the message then refuses). Class
    names, not types, tag the kinds: an error's location holds the tag, and names a field without it."""
    kind = item.get("type", "message") if isinstance(item, dict) else "message"
    found = _ITEM_KINDS.get(kind) if isinstance(kind, str) else None
    return found.__name__ if found is not None else None


# chosen by type, an item's error says what is wrong with it: tried against every kind, a function
# call without a name was refused as "input.0.type: Input should be 'message'"
InputItem = Annotated[Annotated[MessageItem, Tag("MessageItem")] | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
                      | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
                      | Annotated[ReasoningItem, Tag("ReasoningItem")],
                      Discriminator(_item_kind, custom_error_type="invalid_item_type",
                                    custom_error_message="an input item's type is 'message' (the default), "
                                                         "'function_call', 'function_call_output' or 'reasoning'")]


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: Parameters | None = None
    strict: bool | None = None


class FunctionTools(Strict):
    """A request's tools once each is known to be a function: read together, so that an error
    names its field ("tools.0.name")."""

    tools: Items[FunctionTool]


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None   # OpenAI requires one for a schema; without one the schema is named "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def echoed(self) -> dict:
        """The format as the response echoes it: a schema with the name it was given or took."""
        fields = self.model_dump(by_alias=True, exclude_none=True)
        return {**fields, "name": self.name or SCHEMA_NAME} if self.type == "json_schema" else fields


SCHEMA_NAME = "response"


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None   # a hint to OpenAI's models: ignored


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None   # the reasoning comes whole, not summarized
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Strict):
    model: str | None = None
    # none: the instructions alone are the conversation, as OpenAI's API takes them
    input: str | Annotated[Items[InputItem], Field(max_length=MAX_MESSAGES)] | None = Field(None, min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: float | None = _chat_field("temperature")
    top_p: float | None = _chat_field("top_p")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_INT)   # bounded by chat's check_logprobs
    include: Items[str] | None = None
    stream: bool = False
    # read by _chat_tools: a hosted tool is refused by its type
    tools: Items[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    # bounds the hosted tools' turns (OpenAI: built-in tools only); a function call ends the response, so one
    # reply is all there is: echoed, and bounds nothing here
    max_tool_calls: int | None = Field(None, ge=1, le=MAX_INT)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled"] | None = None   # "auto" would drop input items to fit: not offered
    # asks to keep or find responses on the server, which keeps none
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None   # a stored prompt template on OpenAI's side
    # bookkeeping, as in chat
    metadata: Metadata | None = None
    user: MetadataValue | None = None
    service_tier: str | None = None
    prompt_cache_key: MetadataValue | None = None
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    safety_identifier: SafetyIdentifier | None = None
    stream_options: dict[str, Any] | None = None   # OpenAI's include_obfuscation: nothing to obfuscate here
    # vLLM's sampling extras, with chat's bounds
    top_k: int | None = _chat_field("top_k")
    min_p: float | None = _chat_field("min_p")
    repetition_penalty: float | None = _chat_field("repetition_penalty")
    presence_penalty: float | None = _chat_field("presence_penalty")
    frequency_penalty: float | None = _chat_field("frequency_penalty")
    seed: int | None = _chat_field("seed")
    stop: str | Items[str] | None = _chat_field("stop")
    ignore_eos: bool = False
    request_id: str | None = None
    cache_salt: str | None = _chat_field("cache_salt")
    priority: int = _chat_field("priority")
    structured_outputs: StructuredOutputsRequest | None = None   # vLLM's: a regex, grammar, choice or schema

    def check_served(self) -> None:
        """Refuse by name what asks for state this server does not keep, or work it does not do."""
        for name, why in (("previous_response_id", "keeps no responses; send the whole conversation in 'input'"),
                          ("conversation", "keeps no conversations; send the whole conversation in 'input'"),
                          ("background", "answers every request while the client waits; leave it false"),
                          ("prompt", "has no stored prompt templates; send the text in 'input'")):
            if getattr(self, name) not in (None, False):
                raise APIError(f"This server {why}", param=name, code="unsupported_parameter")
        for name in self.include or ():
            if name not in (_LOGPROBS_INCLUDE, reasoning_state.INCLUDE):
                raise APIError(f"'include' may name {_LOGPROBS_INCLUDE} and {reasoning_state.INCLUDE} only, not "
                               f"{name[:80]!r}", param="include", code="unsupported_parameter")

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.include and _LOGPROBS_INCLUDE in self.include) or bool(self.top_logprobs)

    @property
    def replays_reasoning_blobs(self) -> bool:
        """Whether an input item sends back a blob of this server's, which may unpack to a thousand times its length."""
        return isinstance(self.input, list) and any(
            isinstance(item, ReasoningItem) and reasoning_state.written_here(item.encrypted_content)
            for item in self.input)

    @property
    def wants_reasoning_blobs(self) -> bool:
        """Whether reasoning items carry their text as a blob to send back (reasoning_state.py)."""
        return bool(self.include and reasoning_state.INCLUDE in self.include)


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    if not tools:
        return None
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind is None:
            raise APIError(f"tools[{i}] needs a 'type' (function)", param=f"tools[{i}].type")
        if kind != "function":
            raise APIError(f"tools[{i}] is a {str(kind)[:40]!r} tool, which runs on OpenAI's side; this server "
                           "calls function tools only", param=f"tools[{i}].type", code="unsupported_parameter")
    try:
        specs = FunctionTools.model_validate({"tools": tools}).tools
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    return [{"type": "function", "function": spec.model_dump(exclude={"type"}, exclude_none=True)} for spec in specs]


def _chat_messages(req: ResponsesRequest) -> list[dict]:
    """The input as chat messages: consecutive calls join the assistant turn they belong to, and
    replayed reasoning goes with the answer after it."""
    messages: list[dict] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if req.input is None:
        return messages
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    thoughts: list[str] = []   # reasoning since the last message, joined once: added up item by
    # item, 20,000 items took 77 s (a copy of the whole text per item)
    blobs = reasoning_state.Unpacker()
    for index, item in enumerate(req.input):
        if isinstance(item, ReasoningItem):
            # the blob holds the whole reasoning, where a summary only sums it up
            packed = (blobs.text(item.encrypted_content, f"input.{index}.encrypted_content")
                      if item.encrypted_content and not item.content else None)
            thoughts.append(item.text() if packed is None else packed)
            continue
        if isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if not thoughts and last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)   # one assistant turn: its text, then its calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": item.role, "content": item.text()})
        if thoughts and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning"] = "\n".join(t for t in thoughts if t)
        thoughts = []
    return messages


def _response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError("text.format of type json_schema needs a 'schema'", param="text.format.schema")
    spec = {"name": fmt.name or SCHEMA_NAME, "schema": fmt.schema_, "description": fmt.description,
            "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def _tool_choice(choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None) -> Any:
    if isinstance(choice, NamedFunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


# the chat field that a chat check names -> the field of this request that set it
_CHAT_TO_RESPONSES_FIELD = {"messages": "input", "prompt": "input", "max_completion_tokens": "max_output_tokens",
                            "max_tokens": "max_output_tokens", "response_format": "text.format",
                            "reasoning_effort": "reasoning.effort"}
# the chat fields a check's message may spell out: "drop response_format" named a field this request
# has not got. Names that are also words ("messages", "prompt") stay as written in the text
_CHAT_NAMES_IN_TEXT = re.compile(r"\b(?:%s)\b" % "|".join(name for name in _CHAT_TO_RESPONSES_FIELD if "_" in name))


def in_responses_terms(exc: APIError) -> None:
    """Puts a chat check's error in this request's words: the field it names, in `param` and in its message."""
    exc.param = _CHAT_TO_RESPONSES_FIELD.get(exc.param, exc.param)
    exc.message = _CHAT_NAMES_IN_TEXT.sub(lambda found: _CHAT_TO_RESPONSES_FIELD[found.group()], exc.message)


def as_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates this response (n = 1, streamed when this one is)."""
    req.check_served()
    if req.input is None and req.instructions is None:
        raise APIError("Missing required parameter: 'input'", param="input", code="missing_required_parameter")
    messages = _chat_messages(req)
    if not messages:   # reasoning items alone: they go back to the template with the answer after them
        raise APIError("'input' holds no message to answer, only reasoning items; send the conversation's messages "
                       "with them", param="input")
    if len(messages) > MAX_MESSAGES:   # the instructions' system message beside as many input items as allowed
        raise APIError(f"'instructions' and 'input' make a conversation of {len(messages)} messages; at most "
                       f"{MAX_MESSAGES}", param="input", code="array_above_max_length")
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
        "tools": _chat_tools(req.tools), "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text),
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
        "logprobs": req.wants_logprobs, "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
        "stream": req.stream,
        "structured_outputs": req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        if req.structured_outputs is not None else None,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "stop", "ignore_eos", "request_id", "cache_salt", "priority",
                 "user", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier"):
        body[name] = getattr(req, name)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:   # a replayed item the chat request cannot hold (e.g. call arguments too deep)
        raise APIError(f"The input cannot be read as a conversation: {exc.errors()[0]['msg']}",
                       param="input") from None
