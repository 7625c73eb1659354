"""Tool calling on /v1/chat/completions: what tool_choice asks of the model and how it is held to it.

- none: the model answers in text (the template still lists the tools, as in vLLM).
- auto: the model may call; `--tool-call-parser` reads the calls out of its text.
- required / a named function: structured decoding enforces a call, so that even a model that
  never learnt the format produces one whose arguments validate against the function's schema
  (required: a JSON array of {"name", "parameters"}; named: the arguments object itself).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from nanoserve.engine.schema_support import NAMED_SCHEMAS
from nanoserve.server.errors import APIError
from nanoserve.server.chat_protocol import ChatCompletionRequest, Tool
from nanoserve.server.structured import requested_spec
from nanoserve.server.tool_parsers import TOOL_PARSERS, ToolParser
from nanoserve.server.tool_parsers.base import new_call_id
from nanoserve.structured_outputs_params import MAX_SPEC_CHARS, StructuredOutputsParams

ANY_ARGUMENTS = {"type": "object"}
# OpenAI: "Omitting parameters defines a function with an empty parameter list"
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
# an error lists this many of the request's function names, each cut to 80 characters: the
# message must not grow with the request
MAX_NAMES_SHOWN = 20


@dataclass
class ToolPlan:
    """How one request's output is read for tool calls."""

    mode: str = "none"                 # none / auto / required / named
    parser: ToolParser | None = None   # auto: reads calls out of free text
    function: str | None = None        # named: the one function called
    spec: StructuredOutputsParams | None = None  # required / named: the grammar that enforces it
    # parallel_tool_calls false: a reply carries its first call only, as OpenAI and vLLM answer
    # (required's grammar allows one; auto's model may write several, the rest are dropped)
    single: bool = False

    @property
    def active(self) -> bool:
        return self.mode != "none"


def plan_tools(req: ChatCompletionRequest, parser_name: str | None, auto_enabled: bool) -> ToolPlan:
    """The request's tool plan; 400 for a tool_choice it cannot honour, naming the fix."""
    tools, choice = req.tools or [], req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    # counted once each: `names.count` per name was quadratic, and 50,000 tools held the event
    # loop (every stream) for 85 s
    twice = sorted(name for name, count in Counter(t.function.name for t in tools).items() if count > 1)
    if twice:   # a call names its function: two of one name could not be told apart
        raise APIError(f"Each tool needs its own name; {twice[0][:80]!r} is given more than once", param="tools")
    if choice == "none":
        return ToolPlan()
    if not tools:
        if choice == "auto":
            return ToolPlan()
        raise APIError("tool_choice needs 'tools': give the functions the model may call", param="tool_choice")
    asked = requested_spec(req) if choice != "auto" else None
    if asked is not None:   # never silently dropped: the call's own grammar would take its place
        raise APIError(f"tool_choice 'required' or a named function already constrains the output; "
                       f"drop {asked[0]}", param=asked[0])
    if choice == "auto":
        if not (auto_enabled and parser_name):
            raise APIError('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                           "--tool-call-parser NAME; or ask for tool_choice 'required' or a named function",
                           param="tool_choice")
        return ToolPlan("auto", TOOL_PARSERS[parser_name](), single=req.parallel_tool_calls is False)
    if choice == "required":
        if len(tools) * MIN_CALL_CHARS > MAX_SPEC_CHARS:
            # refused before the schema is built and written out on the event loop: for 50,000
            # tools that took 0.9 s of every stream's time, only to find it too long
            raise APIError(f"tool_choice 'required' cannot be enforced over {len(tools)} tools: the grammar that "
                           f"holds a call to one of them is past the structured outputs spec limit "
                           f"({MAX_SPEC_CHARS} characters) beyond {MAX_SPEC_CHARS // MIN_CALL_CHARS} tools",
                           param="tools")
        return ToolPlan("required", spec=call_spec(calls_schema(tools, req.parallel_tool_calls)))
    named = {t.function.name: t for t in tools}.get(choice.function.name)
    if named is None:
        listed = [t.function.name[:80] for t in tools[:MAX_NAMES_SHOWN]]
        more = f" and {len(tools) - MAX_NAMES_SHOWN} more" if len(tools) > MAX_NAMES_SHOWN else ""
        raise APIError(f"tool_choice names the function {choice.function.name[:80]!r}, which is not among the "
                       f"tools {listed}{more}", param="tool_choice")
    return ToolPlan("named", function=named.function.name,
                    spec=call_spec(arguments_schema(named.function.parameters)))


def call_spec(schema: dict) -> StructuredOutputsParams:
    """The grammar that enforces a call; 400 when the tools' schemas are past what one spec may hold."""
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as exc:
        raise APIError(f"The tools' parameter schemas cannot be enforced: {exc}", param="tools") from None


def calls_schema(tools: list[Tool], parallel: bool | None) -> dict:
    """A JSON array of calls, each naming one of the tools and carrying arguments valid for it."""
    # a tool's local `$ref`s ("#/$defs/X", "#") point from the root of its own schema, which is
    # no longer the root here: each is rebased onto where that schema now lies
    schema = {"type": "array", "minItems": 1,
              "items": {"anyOf": [one_call(t.function.name, rebased_refs(t.function.parameters,
                                                                          f"#/items/anyOf/{i}/properties/parameters"))
                                  for i, t in enumerate(tools)]}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def arguments_schema(parameters: dict | None) -> dict:
    """What a call's arguments must match: none for a function given no parameters, any object for
    an empty schema."""
    return NO_ARGUMENTS if parameters is None else parameters or ANY_ARGUMENTS


def one_call(name: str, parameters: dict | None) -> dict:
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                             "parameters": arguments_schema(parameters)},
            "required": ["name", "parameters"]}


# values that are data, not schemas: a "$ref" key inside them is not a reference
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def rebased_refs(schema: dict | None, root: str) -> dict | None:
    """A copy of `schema` in which each local `$ref` ("#...") points below `root` instead of "#";
    the caller's schema (which a response echoes) is left as it was. Walked with a stack, not by
    recursion: a schema may nest as deep as a request body may."""
    if schema is None:
        return None
    top: dict = {}
    stack: list[tuple[dict | list, dict | list, bool]] = [(schema, top, False)]   # (from, to, a name map)
    while stack:
        src, dst, names = stack.pop()
        keyed = isinstance(src, dict) and not names
        for key, value in (src.items() if isinstance(src, dict) else enumerate(src)):
            if keyed and key == "$ref" and isinstance(value, str) and value.startswith("#"):
                value = root + value[1:]
            elif isinstance(value, (dict, list)) and not (keyed and key in _DATA_KEYWORDS):
                copy: dict | list = {} if isinstance(value, dict) else [None] * len(value)
                stack.append((value, copy, keyed and key in NAMED_SCHEMAS))
                value = copy
            dst[key] = value
    return top


# the fewest characters one tool adds to the `required` grammar's schema: a one-letter name, the
# shortest parameters object there is, and the ", " before it
MIN_CALL_CHARS = len(json.dumps(one_call("f", {"": 0}), ensure_ascii=False)) + 2


def tool_call_id(parser: ToolParser | None) -> str:
    """An id for a call the model made: in the parser's format where it has one."""
    return parser.call_id() if parser is not None else new_call_id()
