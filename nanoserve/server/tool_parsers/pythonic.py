"""Pythonic tool calls (vLLM's `pythonic` parser, for Llama 3.2's pythonic template and models
tuned on it): the reply is a Python list of calls, `[get_weather(city="Paris", days=3), now()]`,
each argument a keyword with a literal value; a reply that starts otherwise is content.

The arguments are handed on as JSON, written one argument at a time as each value is read whole
(`ast.literal_eval` of its source), so the text only grows: `{"city": "Paris"`, then `, "days": 3`,
then `}` once the call closes. A value that is no literal, or text that is no call, ends the list.
One reader serves a whole text and a stream alike; it reads each character once.
"""

from __future__ import annotations

import ast
import json
import re

from nanoserve.server.tool_parsers.base import (
    _LONE_SURROGATE, _WHITESPACE, MAX_TOOL_CALLS, Parsed, PartialCall, ToolParser)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPACES = re.compile(r"[ \t]*")
# a name or keyword is read again at each update until what follows it comes: bounded, so that a
# crafted run of letters costs no more than this a token (none it could be is so long)
MAX_NAME_CHARS = 256
MAX_SPACES = 16   # before a keyword's "=", read again likewise
_STRING_STOPS = {q: re.compile(r"[\\" + q + "]") for q in "'\""}


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> Parsed:
        end, calls, _, _ = PythonicStream(0).update(text, final)
        return Parsed(text[:end], calls)

    def stream(self, start: int) -> PythonicStream:
        return PythonicStream(start)


class PythonicStream:
    """The reply from index `start`, read on as it grows (CallStream)."""

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        # lead: before the list; item: a call or the list's end comes next; call: in a call's
        # arguments; value: in an argument's value; after: a call has closed; content, ended: done
        self.state = "lead"
        self.calls: list[PartialCall] = []
        self.closed = 0
        self.key = ""               # the argument whose value is being read, and where it starts
        self.value_at = 0
        self.keys: set[str] = set()  # the open call's arguments written so far
        self.depth = 0              # brackets open in the value
        self.quote = ""             # the string the value is in: ', ", ''' or """ ("" outside one)

    def update(self, text: str, final: bool) -> tuple[int, list[PartialCall], int, int]:
        changed = self.closed
        while self.state not in ("content", "ended") and self._step(text, final):
            pass
        if self.state == "content" or (final and not self.calls):
            self.state = "content"
            return len(text), [], 0, 0
        return self.start, self.calls, self.closed, changed   # calls, or nothing known yet: no content

    def _step(self, text: str, final: bool) -> bool:
        """Read on from self.pos; False when the text read so far says no more."""
        k = len(text)
        if self.state == "value":
            return self._value(text, final)
        self.pos = _WHITESPACE.match(text, self.pos).end()
        if self.pos == k:
            return False
        c = text[self.pos]
        if self.state == "lead":
            self.state, self.pos = ("item", self.pos + 1) if c == "[" else ("content", self.pos)
            return True
        if self.state == "item":
            name = _NAME.match(text, self.pos, self.pos + MAX_NAME_CHARS + 1)
            if name is None or name.end() - self.pos > MAX_NAME_CHARS or len(self.calls) == MAX_TOOL_CALLS:
                return self._end()
            if name.end() == k:
                return False   # the name may go on, or its "(" is yet to come
            if text[name.end()] != "(":
                return self._end()
            self.calls.append(PartialCall(name=name.group(), arguments="{"))
            self.keys = set()
            self.state, self.pos = "call", name.end() + 1
            return True
        if self.state == "call":
            if c == ")":
                return self._close_call()
            key = _NAME.match(text, self.pos, self.pos + MAX_NAME_CHARS + 1)
            if key is None or key.end() - self.pos > MAX_NAME_CHARS:
                return self._end()
            equals = _SPACES.match(text, key.end(), key.end() + MAX_SPACES + 1).end()
            if equals == k:
                return False
            if text[equals] != "=":
                return self._end()
            self.key, self.value_at, self.pos = key.group(), equals + 1, equals + 1
            self.state = "value"
            return True
        # after a call: another one, or the list's end
        if c == ",":
            self.state, self.pos = "item", self.pos + 1
            return True
        self.state = "ended"   # "]" closes the list; anything else ends it too
        return False

    def _value(self, text: str, final: bool) -> bool:
        """Read the value on to the "," or ")" that ends it, then write it into the arguments."""
        k = len(text)
        while self.pos < k:
            if self.quote:
                stop = _STRING_STOPS[self.quote[0]].search(text, self.pos)
                if stop is None:
                    self.pos = k
                    return False
                if text[stop.start()] == "\\":
                    if stop.start() + 1 == k:
                        self.pos = stop.start()
                        return False
                    self.pos = stop.start() + 2
                    continue
                if text.startswith(self.quote, stop.start()):
                    self.quote, self.pos = "", stop.start() + len(self.quote)
                elif len(self.quote) == 3 and stop.start() + 3 > k and not final:
                    self.pos = stop.start()   # may be the start of the closing triple quote
                    return False
                else:
                    self.pos = stop.start() + 1
                continue
            c = text[self.pos]
            if c in "'\"":
                if text.startswith(c * 3, self.pos):
                    self.quote = c * 3
                elif self.pos + 3 > k and (c * 3).startswith(text[self.pos:]) and not final:
                    return False   # "" may yet be the opening of a triple-quoted string
                else:
                    self.quote = c
                self.pos += len(self.quote)
            elif c in "([{":
                self.depth += 1
                self.pos += 1
            elif c in ")]}" and self.depth:
                self.depth -= 1
                self.pos += 1
            elif c in ",)" and not self.depth:
                return self._write_argument(text)
            else:
                self.pos += 1
        return False

    def _write_argument(self, text: str) -> bool:
        try:
            value = _as_json(ast.literal_eval(text[self.value_at:self.pos].strip()))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return self._end()   # no literal, or none JSON can hold (a set, bytes, nan)
        call = self.calls[-1]
        if self.key not in self.keys:   # a keyword repeated: the first stands, as the JSON parsers read a key
            self.keys.add(self.key)
            call.arguments += ("" if call.arguments == "{" else ", ") + json.dumps(self.key, ensure_ascii=False) \
                + ": " + value
        self.state = "call"
        if text[self.pos] == ",":
            self.pos += 1
            return True
        return self._close_call()

    def _close_call(self) -> bool:
        call = self.calls[-1]
        call.arguments += "}"
        call.complete = True
        self.closed += 1
        self.state, self.pos = "after", self.pos + 1
        return True

    def _end(self) -> bool:
        self.state = "ended" if self.calls else "content"
        return False


def _as_json(value: object) -> str:
    """A literal's JSON. A string may escape surrogates ("\\ud800"; Python's "\\ud83d\\ude00" is two of
    them), which UTF-8 cannot encode (the response's serializer raised: a 500): each is written as
    JSON's escape, so that a client reads the string back as the model wrote it."""
    written = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", written)
