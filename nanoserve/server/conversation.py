"""Request messages as chat templates expect them: tool calls with their arguments as objects
(templates write them with `tojson`), tool results with their call id, extra template variables."""

from __future__ import annotations

import inspect
import json
from typing import Any

from transformers import PreTrainedTokenizerBase

from nanoserve.server.errors import APIError
from nanoserve.server.chat_protocol import ChatMessage, Tool

# apply_chat_template's own arguments (whatever this transformers has): a request may not set
# them through chat_template_kwargs, where they would change what is returned, not the template
RESERVED_TEMPLATE_KWARGS = (set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
                            - {"kwargs"}) | {"messages"}


def template_compile_error(template: str) -> str | None:
    """Why `template` does not compile as apply_chat_template compiles it (with transformers' own
    tags), or None when it does."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateError as exc:
        return str(exc)
    return None


def template_message(m: ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": c.type,
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.thought() is not None:
        # Qwen3's and DeepSeek's templates read reasoning_content; others read reasoning
        message["reasoning_content"] = message["reasoning"] = m.thought()
    return message


def _arguments(text: str) -> Any:
    # Llama's and Mistral's templates write arguments with `tojson`: a JSON string would be quoted twice
    try:
        value = json.loads(text)
    except ValueError:
        return text
    # json.loads reads "\ud800" as a lone surrogate, which no text can hold (the tokenizer raised: a
    # 500). A model may write such an escape in its own call (the JSON grammar allows it), and the
    # call comes back in the history: the arguments go to the template as they were written
    if "\\u" in text and _lone_surrogate(value):
        return text
    return value


def _lone_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


def template_inputs(messages: list[ChatMessage], tools: list[Tool] | None, kwargs: dict[str, Any] | None,
                    documents: list[dict[str, str]] | None = None) -> tuple[list[dict], dict[str, Any]]:
    """(conversation, the other keyword arguments of apply_chat_template)."""
    extra = dict(kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(extra))
    if reserved:
        raise APIError(f"chat_template_kwargs may not set {reserved}: those are the template call's own arguments "
                       "(messages, tools and the generation prompt come from the request's fields)",
                       param="chat_template_kwargs")
    if tools:
        extra["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    if documents:   # apply_chat_template's own argument, for retrieval-augmented templates
        extra["documents"] = documents
    return [template_message(m) for m in messages], extra
