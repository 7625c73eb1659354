"""What every tool-call parser shares: a parse of the text so far into content and calls.

`parse` reads a whole output text and returns what it can already tell: the content before any
call and, per call, its name once complete and its arguments as far as they are written.
Streaming sends the difference from the last parse, so a parse must only ever grow: text that may
yet turn out to open a call is held back from the content until it is known. A stream does not
call `parse` at every update (that read the whole text again each time: O(n^2) over a long
output, on the server's event loop); `stream` gives a reader that returns, at every update, what
`parse` would, reading only what is new (tool_parsers/stream.py).
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

_decoder = json.JSONDecoder()


def _first_of_each_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        obj.setdefault(key, value)
    return obj


# a call object's repeated key means its first: a stream names the call from the first "name" it
# sees, and json's last-wins made the whole response name `{"name": "f", "name": "g"}` "g"
_call_decoder = json.JSONDecoder(object_pairs_hook=_first_of_each_key)

# calls read from one choice, in any format; what follows the last of them is not read. No client
# asks for so many; without a bound, crafted output (hermes blocks nested in open calls' strings)
# keeps one open call per block, each read on at every update and decoded whole once it closes
MAX_TOOL_CALLS = 128

# text[start:end] of a stream's text: arguments a stream reads are the text as written, and are
# handed on as where they lie, not copied out at every update
Span = tuple[int, int]


@dataclass
class PartialCall:
    """One tool call as far as the text shows it."""

    name: str | None = None  # set once the name string is complete
    arguments: str | Span = ""  # the arguments object's text as written so far (JSON once complete);
    #                             a Span only from a stream
    complete: bool = False   # the whole call object is closed


@dataclass
class Parsed:
    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


class CallStream(Protocol):
    """Reads one choice's content for calls as it grows, from index `start` of the text it is given."""

    def update(self, text: str, final: bool) -> tuple[int, list[PartialCall], int, int]:
        """For the text so far (the whole of it, every time; never kept): where the content ends
        (it is text[start:that]), the calls, how many calls lead that no later text changes
        (their `complete` aside, which `final` may set), and how many lead whose name and
        arguments are those of the last update (a reader need not look at them again: crafted
        output keeps up to MAX_TOOL_CALLS calls open). Equal to `parse(text[start:], final)`."""


class ToolParser(ABC):
    """Subclasses implement `parse(text, final)` and `stream(start)`; `final` False means more text may follow."""

    name = ""
    # special tokens the format uses: the detokenizer must keep them (e.g. Mistral's [TOOL_CALLS])
    needs_special_tokens = False

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed:
        """The content and calls that `text` shows so far; each later parse only grows it."""

    @abstractmethod
    def stream(self, start: int) -> CallStream:
        """A reader of one streamed choice whose content starts at index `start` of its text."""

    @staticmethod
    def call_id() -> str:
        """A fresh id for a call in this format (the history sent back must carry it)."""
        return new_call_id()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_back(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (may start it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def without_marker_start(text: str, marker: str, final: bool) -> str:
    """`text` less a tail that may yet grow into `marker` (all of it once the text is final)."""
    return text if final else text[:len(text) - held_back(text, marker)]


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
# what json.loads leaves of a "\ud800" escape with no partner: no UTF-8 can encode it, so the
# response's JSON could not be written (a 500, or a stream cut off mid-way)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _encodable(text: str) -> str:
    """Decoded JSON text with each lone surrogate as U+FFFD (a pair was decoded to its character)."""
    return _LONE_SURROGATE.sub("\ufffd", text)


# the decoder recurses once per level: a model's thousand-deep brackets are no call it can read
# whole (as a broken one is not), and the arguments are still shown as far as they are written
_UNREADABLE = (ValueError, RecursionError)


_WHITESPACE = re.compile(r"\s*")


def scan_call(text: str, pos: int = 0) -> tuple[PartialCall, int | None]:
    """A call object `{"name": ..., "arguments": {...}}` at `pos` in `text` (after whitespace), as
    far as it is written; and the index just past it once it is closed, else None."""
    call = PartialCall()
    start = _WHITESPACE.match(text, pos).end()
    try:
        obj, end = _call_decoder.raw_decode(text, start)
    except _UNREADABLE:
        obj, end = None, None
    if isinstance(obj, dict):
        # a name that is no string names no function (str() made {"a": 1} the name "{'a': 1}")
        call.name = _encodable(obj["name"]) if isinstance(obj.get("name"), str) else None
        args = obj.get("arguments", obj.get("parameters", {}))
        call.arguments = _raw_arguments(text[start:end]) or _encodable(json.dumps(args, ensure_ascii=False))
        call.complete = call.name is not None
        return call, end
    name = _NAME.search(text, start)
    args = _ARGS.search(text, start)
    if name and not name_in_arguments(name.start(), args.start() if args else -1):
        call.name = call_name(name.group(1))
    if args:
        call.arguments = _partial_arguments(text[args.end():])
    return call, None


def name_in_arguments(name_at: int, args_at: int) -> bool:
    """Whether a "name" key found at `name_at` of an open call is one of its arguments' (they were
    written first, at `args_at`, -1 if not yet): `{"arguments": {"name": "Bob"}, "name": "add_user"}`
    streamed a call of "Bob". The call's own name is read once its object closes."""
    return 0 <= args_at < name_at


def call_name(written: str) -> str:
    """The name string of a call not closed yet, from its text between the quotes."""
    try:
        return _encodable(json.loads(f'"{written}"', strict=False))  # strict: control characters
    except ValueError:   # a broken escape ("\u12"): the name as the model wrote it
        return written


def _raw_arguments(obj_text: str) -> str | None:
    """The arguments object of a closed call, as the model wrote it (streamed text adds up to it)."""
    match = _ARGS.search(obj_text)
    if not match:
        return None
    try:
        _, end = _decoder.raw_decode(obj_text, match.end())
    except _UNREADABLE:
        return None
    return obj_text[match.end():end]


# a number's characters to the end of the text: the number may go on, so it is not decoded yet
# (decoded at every update while its digits came, a 40k-digit run cost O(n^2))
NUMBER_RUN = re.compile(r"[-0-9][-+.eE0-9]*")


def _partial_arguments(tail: str) -> str:
    """What is written of an arguments object that is not closed yet (all of it is its own); a bare
    number that runs to the end of the text, as written."""
    if NUMBER_RUN.fullmatch(tail):
        return tail
    try:
        _, end = _decoder.raw_decode(tail)
        return tail[:end]
    except _UNREADABLE:
        return tail.rstrip()  # trailing whitespace may come before a closing brace: keep it for later


def scan_call_list(text: str, separator: str = ",") -> list[PartialCall]:
    """Call objects one after another (`{...}, {...}` or `{...}; {...}`), up to what is not one
    (or up to MAX_TOOL_CALLS)."""
    return scan_calls(text, 0, separator)[0]


def scan_calls(text: str, pos: int, separator: str = ",", after_call: bool = False
               ) -> tuple[list[PartialCall], int, int]:
    """scan_call_list from `pos` (`after_call`: a closed call ends there, so a separator may come
    first). Returns the calls, the index just past the last closed one (`pos` when none closed)
    and how many closed: a stream resumes there at its next update instead of reading every
    closed call again."""
    calls: list[PartialCall] = []
    closed_at, closed = pos, 0
    while True:
        # by index, never a copy of the rest: a stream parses its text again at every update
        pos = _WHITESPACE.match(text, pos).end()
        if (calls or after_call) and text.startswith(separator, pos):
            pos = _WHITESPACE.match(text, pos + len(separator)).end()
        if not text.startswith("{", pos) or len(calls) == MAX_TOOL_CALLS:
            return calls, closed_at, closed
        call, end = scan_call(text, pos)
        calls.append(call)
        if end is None:
            return calls, closed_at, closed
        pos = closed_at = end
        closed += 1
