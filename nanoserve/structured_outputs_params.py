"""A grammar a request's output must follow: its spec, the bounds it is held to, and JSON nesting depth."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


MAX_SPEC_CHARS = 128 * 1024   # a schema, regex or grammar text, or all choices together
MAX_CHOICES = 2048
# as deep as a JSON request body may nest (pydantic's parser stops at 200): a schema sent as text
# would otherwise reach xgrammar's own guard, in the thousands, and its compile time grows with
# the cube of the depth (800 levels of arrays: a minute and 1 GB; 5000: hours and 6 GB)
MAX_SPEC_DEPTH = 200
# a JSON string, escapes included (unrolled: ~4x faster than an alternation on long text); the
# server counts a body's values with it too
JSON_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'
_JSON_STRING = re.compile(JSON_STRING)


@dataclass
class StructuredOutputsParams:
    """A grammar the output must follow; exactly one of json, json_object, regex, choice, grammar.

    Plain JSON-able fields only: the engine compiles it (and caches by `key`) in its own process.
    """

    json: str | dict[str, Any] | None = None  # a JSON schema (an object is kept as its JSON text)
    json_object: bool = False                  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None            # exactly one of these strings
    grammar: str | None = None                 # EBNF (GBNF), xgrammar's dialect
    disable_any_whitespace: bool = False       # vLLM's: JSON in one layout, without optional whitespace
    # a reasoning model's thinking is left free (engine/reasoning_gate.py): the grammar holds from
    # the token after `reasoning_end_id`; an output may open its reasoning with `reasoning_start_id`,
    # or start inside it where the prompt opened it (`reasoning_open`). A server with
    # --reasoning-parser fills these for chat requests
    reasoning_start_id: int | None = None
    reasoning_end_id: int | None = None
    reasoning_open: bool = False
    # vLLM's other options: xgrammar, the one backend (no fallback), already refuses properties a
    # schema does not allow; the last two are refused
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(self, name) is not None:
                raise ValueError(f"structured outputs' {name} is not supported here; give json, json_object, regex, "
                                 "choice or grammar (disable_any_whitespace: JSON with no optional whitespace)")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice and grammar; "
                             f"got {given or 'none'}")
        if self.choice is not None and not self.choice:
            raise ValueError("structured outputs 'choice' needs at least one string")
        if self.choice is not None and len(self.choice) > MAX_CHOICES:
            raise ValueError(f"structured outputs 'choice' takes at most {MAX_CHOICES} strings, got {len(self.choice)}")
        if isinstance(self.json, dict):
            # as text: the engine's messages carry it whatever its numbers (msgspec holds 64 bits),
            # and the compile cache tells schemas apart by their property order, which the
            # grammar follows
            self.json = schema_text(self.json)
        size = sum(len(text) for text in (self.json, self.regex, self.grammar, *(self.choice or ())) if text)
        if size > MAX_SPEC_CHARS:
            # compile time grows faster than the spec (a 200,000-choice list took minutes)
            raise ValueError(f"the structured outputs spec is {size} characters long; at most {MAX_SPEC_CHARS}")
        for name in ("reasoning_start_id", "reasoning_end_id"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"structured outputs' {name} must be a token id (an int >= 0), got {value!r}")
        if self.reasoning_end_id is None and (self.reasoning_start_id is not None or self.reasoning_open):
            raise ValueError("structured outputs' reasoning_start_id and reasoning_open need reasoning_end_id, "
                             "the token that ends the reasoning")
        depth = json_depth(self.json) if self.json is not None else 0
        if depth > MAX_SPEC_DEPTH:
            raise ValueError(f"the JSON schema nests {depth} levels deep; at most {MAX_SPEC_DEPTH}")

    @property
    def any_whitespace(self) -> bool:
        """Whether JSON may hold whitespace where the grammar allows it (xgrammar's switch)."""
        return not self.disable_any_whitespace

    @property
    def key(self) -> tuple:
        """Equal for specs that compile to the same grammar: the compile cache's key."""
        return (self.json, self.json_object, self.regex, tuple(self.choice or ()), self.grammar, self.any_whitespace)


def schema_text(schema: dict) -> str:
    """The schema as json.dumps writes it, written piece by piece so that one far over
    MAX_SPEC_CHARS is refused early: json.dumps wrote a 10 MB schema whole (~0.2-0.6 s on the
    event loop) before the size check refused it."""
    pieces, size = [], 0
    for piece in json.JSONEncoder(ensure_ascii=False).iterencode(schema):
        pieces.append(piece)
        size += len(piece)
        if size > MAX_SPEC_CHARS:
            raise ValueError(f"the structured outputs spec is over {MAX_SPEC_CHARS} characters long; "
                             f"at most {MAX_SPEC_CHARS}")
    return "".join(pieces)


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(text: str) -> int:
    """How deep a JSON text nests objects and arrays; brackets inside strings do not count.

    In C and numpy, never a Python step per bracket: a request may hold 30 MB of brackets in a
    string (tool-call arguments), which a per-bracket walk took 7.5 s over, holding the GIL."""
    # no byte of a multi-byte UTF-8 character is a bracket, so deleting bytes keeps exactly the brackets
    brackets = _JSON_STRING.sub("", text).encode("utf-8", "surrogatepass").translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    import numpy as np   # here: the front end's --help stays light

    # "[" 91 and "{" 123 open, "]" 93 and "}" 125 close: the 2 bit is set in the openers only
    steps = (np.frombuffer(brackets, dtype=np.uint8) & 2).view(np.int8) - 1
    return max(int(np.cumsum(steps, dtype=np.int32).max()), 0)
