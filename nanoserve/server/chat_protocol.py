"""Chat request bodies: messages, tools and the chat completion request, and the tokenizer
endpoints' bodies, which take a prompt or messages. Validated as protocol.py validates."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator
from pydantic_core import PydanticCustomError

from nanoserve.sampling_params import MAX_INT
from nanoserve.server.protocol import (FIRST_ERROR, MAX_CONTENT_PARTS, MAX_DOCUMENTS, MAX_MESSAGES,
                                       MAX_TOOL_CALLS_PER_MESSAGE, MAX_TOOLS, Items, SamplingFields, Strict)
from nanoserve.structured_outputs_params import MAX_SPEC_DEPTH, json_depth


class TextPart(Strict):
    # vLLM reads the Responses API's names for a text part in chat messages too
    type: Literal["text", "input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None   # an output_text's, replayed from the Responses API: unused
    logprobs: list[Any] | None = None


class RefusalPart(Strict):
    """An assistant's earlier refusal, as OpenAI's API replays it in history; read as its text."""
    type: Literal["refusal"]
    refusal: str


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _bounded_depth(cls, text: str) -> str:
        # the text is parsed for the chat template (json.loads, then `tojson`), and both recurse
        # per level: 50,000 brackets raised RecursionError, a 500. The body itself may nest no deeper
        depth = json_depth(text)
        if depth > MAX_SPEC_DEPTH:
            raise ValueError(f"the arguments nest {depth} levels deep; at most {MAX_SPEC_DEPTH}")
        return text


class ToolCall(Strict):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[Items[TextPart | RefusalPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: Items[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS_PER_MESSAGE)  # assistant messages
    tool_call_id: str | None = None           # tool messages: the call this answers
    # assistant messages' reasoning, as this server returns it: vLLM's current name, and the older
    # one that DeepSeek's API and many clients still send
    reasoning: str | None = None
    reasoning_content: str | None = None
    # an assistant message as OpenAI's API returns it, replayed by its client: a refusal is what the
    # assistant said (as a refusal part is); annotations (web citations) are no text of the message
    refusal: str | None = None
    annotations: Items[dict[str, Any]] | None = Field(None, max_length=MAX_CONTENT_PARTS)

    def text(self) -> str:
        if isinstance(self.content, list):  # as vLLM joins them: parts are often a document, then a question
            return "\n".join(part.text if isinstance(part, TextPart) else part.refusal for part in self.content)
        return self.content or self.refusal or ""

    def thought(self) -> str | None:
        """The reasoning under either name (vLLM's own, `reasoning`, where both are sent)."""
        return self.reasoning if self.reasoning is not None else self.reasoning_content


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    # a call's arguments are a JSON object (OpenAI requires "type": "object"): a string schema was
    # enforced, and the call then came back marked incomplete, its arguments being no object
    if schema.get("type", "object") != "object":
        raise PydanticCustomError("object_schema", "a function's parameters are the JSON schema of an object "
                                  '("type": "object"), not of {kind}', {"kind": repr(schema["type"])[:40]})
    return schema


# a JSON schema of the arguments object; None: no arguments
Parameters = Annotated[dict[str, Any], AfterValidator(_object_schema)]


class FunctionDefinition(Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: Parameters | None = None
    strict: bool | None = None  # the arguments follow the schema whenever the grammar enforces it


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Items[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: Items[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = None  # False: at most one call (enforced when tool_choice is required)
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template (enable_thinking)
    # OpenAI's, as vLLM takes it: a variable of the chat template (unless chat_template_kwargs sets
    # it), which templates that know no such setting ignore
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # vLLM's: documents for retrieval-augmented templates (Command R, Granite), as the template's `documents`
    documents: Items[Annotated[dict[str, str], FIRST_ERROR]] | None = Field(None, max_length=MAX_DOCUMENTS)
    include_reasoning: bool = True         # vLLM's: False leaves the parsed reasoning out of the reply
    add_generation_prompt: bool = True     # vLLM's: False leaves the assistant's header out
    continue_final_message: bool = False   # vLLM's: the reply continues the last message, left open
    echo: bool = False   # vLLM's: the reply repeats the last message first when it speaks as its author
    # vLLM's: off, since the chat template writes every special token the model expects (BOS included)
    add_special_tokens: bool = False
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)  # the OpenAI API's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_INT)   # bounded by check_logprobs
    modalities: Items[Literal["text"]] | None = None  # text is what this server writes; "audio" is refused by name
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint to OpenAI's models: ignored, as in responses


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: Items[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    tools: Items[Tool] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False   # vLLM's, as in chat completions
    return_token_strs: bool = False        # vLLM's: each token's vocabulary string beside its id


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: Items[int]
