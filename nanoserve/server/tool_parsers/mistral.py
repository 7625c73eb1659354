"""Mistral format (7B v0.3, Nemo, Small): content, then `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.
`[TOOL_CALLS]` is a special token, so such requests keep special tokens in the text."""

from __future__ import annotations

import random
import re
import string

from nanoserve.server.tool_parsers.base import (
    _WHITESPACE, Parsed, PartialCall, ToolParser, held_back, scan_call_list, without_marker_start)
from nanoserve.server.tool_parsers.stream import ListScanner, find_from

MARKER = "[TOOL_CALLS]"
_MARKER = re.compile(re.escape(MARKER))


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    @staticmethod
    def call_id() -> str:
        # Mistral's template refuses history whose call ids are not 9 alphanumerics
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(MARKER)
        if at < 0:
            return Parsed(without_marker_start(text, MARKER, final))
        rest = text[at + len(MARKER):].lstrip()
        if rest.startswith("["):
            rest = rest[1:]
        calls = scan_call_list(rest)   # stops at the list's closing bracket
        return Parsed(text[:at], calls)  # as streamed: the same content whole or in deltas

    def stream(self, start: int) -> MistralStream:
        return MistralStream(start)


class MistralStream:
    """`parse` of text[start:] as the text grows: the marker is searched for once, the list read on."""

    def __init__(self, start: int) -> None:
        self.start = self.seek = start   # no marker begins before seek
        self.at = -1                     # where the marker begins, once written
        self.calls: ListScanner | None = None

    def update(self, text: str, final: bool) -> tuple[int, list[PartialCall], int, int]:
        k = len(text)
        if self.at < 0:
            self.at, self.seek = find_from(_MARKER, text, self.seek, len(MARKER))
            if self.at < 0:
                held = 0 if final else held_back(text[max(self.start, k - len(MARKER) + 1):], MARKER)
                return k - held, [], 0, 0
            self.seek = self.at + len(MARKER)
        if self.calls is None:
            self.seek = _WHITESPACE.match(text, self.seek).end()
            if self.seek == k:
                return self.at, [], 0, 0
            self.calls = ListScanner(self.seek + (text[self.seek] == "["))
        return self.at, *self.calls.update(text)
