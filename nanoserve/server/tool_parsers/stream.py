"""Tool calls read out of a streamed text as it grows, at a cost in proportion to what each update adds.

`scan_call` and `scan_calls` (base.py) read a call from its start. Called at every update of a
stream, a call (or the content before one) of n characters cost O(n) per update and O(n^2) over
the stream, on the event loop every other stream shares: a 160 kB call took 16 s. The readers here
keep how far they got and return, at every update, exactly what those functions return for the
text so far. A regex search tries each start in turn and, for these patterns, reads forward from
it without choices; an attempt that the end of the text cut short is resumed where it stopped.

Positions are indices into the stream's whole text, which the caller owns and passes at every
update: a reader never keeps it (see ChoiceReader.delta). Every scan of the text goes through this
module's compiled patterns and decoder, which lets a test count the characters read.
"""

from __future__ import annotations

import re

from collections.abc import Callable

from nanoserve.server.tool_parsers.base import (
    _UNREADABLE, _WHITESPACE, MAX_TOOL_CALLS, PartialCall, Span, _decoder, call_name, name_in_arguments, scan_call)

# what a JSON value's end depends on: outside a string its brackets and quotes, inside one its
# quote and escapes
_OUTSIDE = re.compile(r'[^"\[\]{}]*')
_INSIDE = re.compile(r'[^"\\]*')
_NAME_KEY, _ARGS_KEY = re.compile(r'"name"'), re.compile(r'"(?:arguments|parameters)"')
_NAME_STRING = re.compile(r'(?:[^"\\]|\\.)*')   # base._NAME's string, as far as it goes
_NUMBER_CHARS = re.compile(r"[-+.eE0-9]*")   # base.NUMBER_RUN, as far as it goes


def find_from(pattern: re.Pattern, text: str, seek: int, width: int) -> tuple[int, int]:
    """Where `pattern` (a literal of `width` characters) first occurs at or after `seek`, or -1;
    and where the next search may start (no occurrence can begin before it)."""
    found = pattern.search(text, seek)
    return (found.start(), seek) if found else (-1, max(seek, len(text) - width + 1))


def lex_step(text: str, pos: int, in_string: bool) -> tuple[int, bool, int, bool]:
    """One character that can move a JSON value's end, read from `pos`: (the position after it,
    whether in a string after it, the depth change, read). read is False where the text ran out
    first; the position is then how far the run got, where the next update resumes."""
    k = len(text)
    if in_string:
        pos = _INSIDE.match(text, pos).end()
        if pos == k or (text[pos] == "\\" and pos + 1 == k):
            return pos, True, 0, False   # the escaped character is not written yet
        if text[pos] == "\\":
            return pos + 2, True, 0, True
        return pos + 1, False, 0, True
    pos = _OUTSIDE.match(text, pos).end()
    if pos == k:
        return pos, False, 0, False
    char = text[pos]
    if char == '"':
        return pos + 1, True, 0, True
    return pos + 1, False, 1 if char in "{[" else -1, True


class ValueEnd:
    """Where the JSON object, array or string starting at `pos` would end: the first point its
    brackets balance outside strings. Valid JSON lexes the same way, so no decoder can read the
    value before that point: it is decoded once, there, instead of at every update."""

    def __init__(self, pos: int) -> None:
        self.pos, self.depth, self.in_string = pos, 0, False

    def feed(self, text: str) -> int | None:
        """The index just past the value once it has closed, else None."""
        while self.pos < len(text):
            self.pos, self.in_string, delta, read = lex_step(text, self.pos, self.in_string)
            if not read:
                return None
            self.depth += delta
            if self.depth == 0 and not self.in_string:
                return self.pos
        return None


class SharedValueEnds:
    """ValueEnd of many open objects at once, each character read once per lexer state rather than
    once per object: hermes blocks nested in open calls' strings leave up to MAX_TOOL_CALLS objects
    open, each of which read every update (100 of them, 8 s over a 160 kB stream). Two lexers at
    the same position in the same state (in a string or not) read the rest alike and differ only
    in depth, by a constant: they share a lane, where each object's depth is the lane's count less
    its base, so the object of highest base is the first to close. Every lane reads to the end of
    the text, where at most three states exist (outside a string; in one; in one before a backslash
    whose escaped character is not written yet): at most three lanes read each character."""

    def __init__(self) -> None:
        self.lanes: list[_Lane] = []

    def add(self, value: ValueEnd, key: object) -> None:
        """An object that `value` has lexed to the end of the text without its closing."""
        self.lanes.append(_Lane(value, key))
        self._merge()

    def feed(self, text: str) -> list[tuple[object, int]]:
        """Reads on to the end of the text: the key of each object that closed, and the index just
        past it (each closes once, and is no longer lexed)."""
        closed: list[tuple[object, int]] = []
        for lane in self.lanes:
            lane.feed(text, closed)
        self.lanes = [lane for lane in self.lanes if lane.members]
        self._merge()
        return closed

    def keep(self, kept: Callable[[object], bool]) -> None:
        """Stop lexing the objects whose key is not `kept`."""
        for lane in self.lanes:
            lane.members = [m for m in lane.members if kept(m[1])]
            lane.top = max((base for base, _ in lane.members), default=None)
        self.lanes = [lane for lane in self.lanes if lane.members]

    def _merge(self) -> None:
        by_state: dict[tuple[int, bool], _Lane] = {}
        for lane in sorted(self.lanes, key=lambda lane: -len(lane.members)):
            into = by_state.setdefault((lane.pos, lane.in_string), lane)
            if into is not lane:   # rebased on the larger lane's count: each object moves O(log n) times
                shift = into.depth - lane.depth
                into.members += [(base + shift, key) for base, key in lane.members]
                into.top = max(into.top, lane.top + shift)
        self.lanes = list(by_state.values())


class _Lane:
    """ValueEnd shared by objects in one lexer state: an object's depth is `depth - base`."""

    def __init__(self, value: ValueEnd, key: object) -> None:
        self.pos, self.in_string, self.depth = value.pos, value.in_string, value.depth
        self.members: list[tuple[int, object]] = [(0, key)]   # (base, key)
        self.top: int | None = 0   # the highest base: depth reaches it first

    def feed(self, text: str, closed: list[tuple[object, int]]) -> None:
        while self.pos < len(text) and self.members:
            self.pos, self.in_string, delta, read = lex_step(text, self.pos, self.in_string)
            if not read:
                return
            self.depth += delta
            if delta < 0 and self.depth == self.top:   # objects at depth 0: closed here
                closed += [(key, self.pos) for base, key in self.members if base == self.top]
                self.members = [m for m in self.members if m[0] != self.top]
                self.top = max((base for base, _ in self.members), default=None)


class KeyFinder:
    """`re.search` of base._ARGS (`"key"\\s*:\\s*`) or, with `string`, of base._NAME (then a
    string), in a growing text. Once `advance` is True it stays True: for _ARGS, `pos` is the
    match's end (it grows while the text ends in spaces); for _NAME the string is text[value:pos]."""

    def __init__(self, key: re.Pattern, key_len: int, string: bool, seek: int) -> None:
        self.key, self.key_len, self.string = key, key_len, string
        self.seek = seek            # no match starts before this
        self.at = self.pos = self.value = -1   # the attempt under way: its start, how far it has read
        self.step = 0   # 0: find the key; 1: spaces, then the colon; 2: spaces after it; 3: the string; 4: matched

    def advance(self, text: str) -> bool:
        k = len(text)
        while self.step != 4:
            if self.step == 0:
                found = self.key.search(text, self.seek)
                if found is None:
                    self.seek = max(self.seek, k - self.key_len + 1)   # a key the end cut short
                    return False
                self.at, self.pos, self.step = found.start(), found.end(), 1
            elif self.step == 3:
                self.pos = _NAME_STRING.match(text, self.pos).end()
                if self.pos == k or (text[self.pos] == "\\" and self.pos + 1 == k):
                    return False
                if text[self.pos] == '"':
                    self.step = 4
                else:   # a backslash before a newline, which `.` does not match: no match here
                    self.seek, self.step = self.at + 1, 0
            else:
                self.pos = _WHITESPACE.match(text, self.pos).end()
                if self.pos == k:
                    return self.step == 2 and not self.string   # _ARGS matches already; more spaces may come
                if self.step == 1 and text[self.pos] == ":":
                    self.pos, self.step = self.pos + 1, 2
                elif self.step == 2 and not self.string:
                    self.step = 4
                elif self.step == 2 and text[self.pos] == '"':
                    self.pos = self.value = self.pos + 1
                    self.step = 3
                else:
                    self.seek, self.step = self.at + 1, 0
        return True


class CallScanner:
    """scan_call(text, pos) for a growing text: (the call as far as written, the index past it once closed)."""

    def __init__(self, pos: int) -> None:
        self.pos = pos
        self.started = False
        self.closed: tuple[PartialCall, int] | None = None
        self.object: ValueEnd | None = None   # an object that may yet close into a call
        self.call = PartialCall()
        # the keys start with a quote, which no space is: searching from `pos` finds what
        # searching from the object's first character does
        self.name = KeyFinder(_NAME_KEY, 6, True, pos)
        self.args = KeyFinder(_ARGS_KEY, 12, False, pos)
        self.value: ValueEnd | None = None   # the arguments value, while it may yet close
        self.value_kind = ""   # "": not begun; "lexed": an object, array or string; "number"; "scalar"; "whole"; "never"
        self.value_end = -1    # "whole": where the decoded value ends; "number": how far its characters go
        self.seen = self.nonspace = -1   # read up to; the end of the last non-space character from the value on

    def update(self, text: str) -> tuple[PartialCall, int | None]:
        if self.closed is None:
            self._read(text)
        return self.closed or (self.call, None)

    def detach(self) -> ValueEnd | None:
        """The lexer of the object while it may yet close into a call, handed to a caller that
        lexes it among others (SharedValueEnds) and calls `object_closed` where it closes; from
        here on this scanner reads nothing until then."""
        value, self.object = self.object, None
        return value

    def object_closed(self, text: str) -> bool:
        """The detached object has closed: decoded once, as `update` does. True: it is a call."""
        call, end = scan_call(text, self.pos)
        if end is not None:
            self.closed = (call, end)
        return end is not None

    def _read(self, text: str) -> None:
        k = len(text)
        if not self.started:
            self.pos = _WHITESPACE.match(text, self.pos).end()
            if self.pos == k:
                return
            self.started = True
            # only an object is a call: anything else is read by the regexes alone, as scan_call does
            self.object = ValueEnd(self.pos) if text[self.pos] == "{" else None
        if self.object is not None and self.object.feed(text) is not None:
            # decoded once: a call, or never one (a decoder that failed inside it fails on any longer text)
            self.object = None
            call, end = scan_call(text, self.pos)
            if end is not None:
                self.closed = (call, end)
                return
        args = self.args.advance(text)
        if (self.call.name is None and self.name.advance(text)
                and not name_in_arguments(self.name.at, self.args.at if args else -1)):
            self.call.name = call_name(text[self.name.value:self.name.pos])
        if args:
            self.call.arguments = self._arguments(text)

    def _arguments(self, text: str) -> Span:
        """base._partial_arguments of the text after the arguments key."""
        begin, k = self.args.pos, len(text)
        if begin == k:
            return (k, k)
        if not self.value_kind:
            first = text[begin]
            self.value_kind = "lexed" if first in '{["' else "number" if first in "-0123456789" else "scalar"
            self.value = ValueEnd(begin) if self.value_kind == "lexed" else None
            self.seen = self.nonspace = self.value_end = begin
        tail = text[self.seen:k].rstrip()   # what this update added, as str.rstrip sees it
        if tail:
            self.nonspace = self.seen + len(tail)
        self.seen = k
        if self.value_kind == "lexed" and self.value.feed(text) is not None:
            self.value_end = self._decoded_end(text, begin)
            self.value_kind = "whole" if self.value_end >= 0 else "never"
        if self.value_kind == "number":
            self.value_end = _NUMBER_CHARS.match(text, self.value_end).end()
            if self.value_end == k:   # it may go on: as written (base._partial_arguments)
                return (begin, k)
            if self.value_end - begin > 1 or text[begin] != "-":   # ended: its decoding can no longer change ("-" may be -Infinity)
                self.value_end = self._decoded_end(text, begin)
                self.value_kind = "whole" if self.value_end >= 0 else "never"
        if self.value_kind in ("scalar", "number"):   # a word or "-": decoded again (it fails or ends within 9 characters)
            end = self._decoded_end(text, begin)
            return (begin, end) if end >= 0 else (begin, self.nonspace)
        return (begin, self.value_end) if self.value_kind == "whole" else (begin, self.nonspace)

    @staticmethod
    def _decoded_end(text: str, pos: int) -> int:
        try:
            return _decoder.raw_decode(text, pos)[1]
        except _UNREADABLE:
            return -1


class ListScanner:
    """scan_calls(text, pos, separator) for a growing text: each closed call is read once."""

    def __init__(self, pos: int, separator: str = ",") -> None:
        self.pos, self.separator = pos, separator
        self.calls: list[PartialCall] = []   # the closed calls, then the open one
        self.scanner: CallScanner | None = None
        self.separated = False   # the separator after the last closed call is read
        self.ended = False       # what follows is not a call: the list is over

    def update(self, text: str) -> tuple[list[PartialCall], int, int]:
        """The calls, how many of them are closed (those never change) and how many lead that are
        the same as at the last update (those closed before it)."""
        k, changed = len(text), len(self.calls) - (self.scanner is not None)
        while not self.ended:
            if self.scanner is None:
                if len(self.calls) == MAX_TOOL_CALLS:
                    self.ended = True
                    break
                self.pos = _WHITESPACE.match(text, self.pos).end()
                if self.calls and not self.separated and text.startswith(self.separator, self.pos):
                    self.pos = _WHITESPACE.match(text, self.pos + len(self.separator)).end()
                    self.separated = True
                if self.pos == k:
                    break
                if text[self.pos] != "{":
                    self.ended = True
                    break
                self.scanner = CallScanner(self.pos)
                self.calls.append(PartialCall())
            call, end = self.scanner.update(text)
            self.calls[-1] = call
            if end is None:
                break
            self.scanner, self.pos, self.separated = None, end, False
        return self.calls, len(self.calls) - (self.scanner is not None), changed
