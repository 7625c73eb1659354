"""Hermes format (Qwen2.5, Qwen3, Hermes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call, after optional content."""

from __future__ import annotations

import re

from nanoserve.server.tool_parsers.base import (
    Parsed, PartialCall, ToolParser, held_back, scan_call, without_marker_start)
from nanoserve.server.tool_parsers.stream import CallScanner, find_from

START, END = "<tool_call>", "</tool_call>"
_START, _END = re.compile(re.escape(START)), re.compile(re.escape(END))


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(START)
        if at < 0:
            return Parsed(without_marker_start(text, START, final))
        parsed = Parsed(text[:at])  # as streamed: the same content whole or in deltas
        while at >= 0:
            body = text[at + len(START):]
            # a closed object ends the call, whatever tags its strings hold; an open one runs to its end tag
            call, end = scan_call(body)
            if end is None:
                end = body.find(END) if END in body else len(body)
                call, _ = scan_call(body[:end])
            rest = body[end:]
            following = rest.find(START)
            call.complete = call.complete and (END in rest[:following if following >= 0 else None] or final)
            parsed.calls.append(call)
            at = -1 if following < 0 else len(text) - len(rest) + following
        return parsed

    def stream(self, start: int) -> HermesStream:
        return HermesStream(start)


class HermesStream:
    """`parse` of text[start:] as the text grows: the content is searched once for the first tag,
    and each block is read on from where the last update left it."""

    def __init__(self, start: int) -> None:
        self.start = self.seek = start   # no tag begins before seek
        self.content_end = -1            # where the first tag begins, once written
        self.blocks: list[_Block] = []
        self.calls: list[PartialCall] = []
        self.settled = 0                 # leading blocks whose call and following block are written

    def update(self, text: str, final: bool) -> tuple[int, list[PartialCall], int]:
        k = len(text)
        if not self.blocks:
            at, self.seek = find_from(_START, text, self.seek, len(START))
            if at < 0:
                held = 0 if final else held_back(text[max(self.start, k - len(START) + 1):], START)
                return k - held, [], 0
            self.content_end = at
            self.blocks.append(_Block(at + len(START)))
            self.calls.append(PartialCall())
        i = self.settled
        while i < len(self.blocks):
            block = self.blocks[i]
            following = block.update(text)
            self.calls[i] = block.call(final)
            after = self.blocks[i + 1].body if i + 1 < len(self.blocks) else -1
            if following < 0 or after != following + len(START):
                # the calls after an open block move when it closes: read them again from there
                del self.blocks[i + 1:], self.calls[i + 1:]
                if following >= 0:
                    self.blocks.append(_Block(following + len(START)))
                    self.calls.append(PartialCall())
            if i == self.settled and block.settled(following):
                self.settled += 1
            i += 1
        if final:   # a call closed but never ended by its tag is complete at the end of the text
            self.calls[:self.settled] = [block.call(final) for block in self.blocks[:self.settled]]
        return self.content_end, self.calls, self.settled


class _Block:
    """One `<tool_call>` block of HermesToolParser.parse, from its body on."""

    def __init__(self, body: int) -> None:
        self.body = body
        self.scanner = CallScanner(body)
        self.found = PartialCall()
        self.closed = False
        # the text after the call (parse's `rest`) begins at its end, or at an end tag inside an
        # open one: the first end tag from the body (open) or the rest (closed), and the following
        # block's tag from the rest
        self.end_at, self.end_seek = -1, body
        self.next_at, self.next_seek = -1, body

    def update(self, text: str) -> int:
        """Where the following block's tag begins, or -1 while none is written."""
        call, end = self.scanner.update(text)
        if end is not None and not self.closed:   # closed: what follows it is read again from its end
            self.closed, self.found = True, call
            self.end_at, self.end_seek, self.next_at, self.next_seek = -1, end, -1, end
        if not self.closed:
            if self.end_at < 0:
                self.end_at, self.end_seek = find_from(_END, text, self.end_seek, len(END))
                if self.end_at >= 0:   # the open call as far as the end tag: read once
                    self.next_seek = self.end_at
                    self.found = scan_call(text[self.body:self.end_at])[0]
            if self.end_at < 0:
                self.found = call
                return -1
        elif self.end_at < 0:
            self.end_at, self.end_seek = find_from(_END, text, self.end_seek, len(END))
        if self.next_at < 0:
            self.next_at, self.next_seek = find_from(_START, text, self.next_seek, len(START))
        return self.next_at

    def call(self, final: bool) -> PartialCall:
        ended = self.end_at >= 0 and (self.next_at < 0 or self.end_at < self.next_at)
        found = self.found
        return PartialCall(found.name, found.arguments, found.complete and (ended or final))

    def settled(self, following: int) -> bool:
        return self.closed and following >= 0
