"""Hermes format (Qwen2.5, Qwen3, Hermes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call, after optional content."""

from __future__ import annotations

import re

from nanoserve.server.tool_parsers.base import (
    MAX_TOOL_CALLS, Parsed, PartialCall, ToolParser, held_back, scan_call, without_marker_start)
from nanoserve.server.tool_parsers.stream import CallScanner, SharedValueEnds, find_from

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
                # an open object runs to its end tag, or to a tail that may yet become one: a model's
                # call left open before its tag ("{"a": 1</tool_call>") streamed "</too" as arguments
                end = body.find(END) if END in body else len(body) - (0 if final else held_back(body, END))
                call, _ = scan_call(body[:end])
            rest = body[end:]
            following = rest.find(START)
            call.complete = call.complete and (END in rest[:following if following >= 0 else None] or final)
            parsed.calls.append(call)
            # past MAX_TOOL_CALLS blocks the text is not read, as text between blocks is not
            at = -1 if following < 0 or len(parsed.calls) == MAX_TOOL_CALLS else len(text) - len(rest) + following
        return parsed

    def stream(self, start: int) -> HermesStream:
        return HermesStream(start)


class HermesStream:
    """`parse` of text[start:] as the text grows: the content is searched once for the first tag,
    and the last block is read on from where the last update left it. A block followed by another
    is settled, save for an open call's object that may yet close (its string can hold the next
    blocks' tags): such objects are lexed together (SharedValueEnds), not one by one at every update,
    and the one that closes is decoded once there."""

    def __init__(self, start: int) -> None:
        self.start = self.seek = start   # no tag begins before seek
        self.content_end = -1            # where the first tag begins, once written
        self.blocks: list[_Block] = []
        self.calls: list[PartialCall] = []
        self.settled = 0                 # leading blocks whose call and following block are written
        self.open = SharedValueEnds()    # the objects of open blocks that another block follows

    def update(self, text: str, final: bool) -> tuple[int, list[PartialCall], int, int]:
        k = len(text)
        if not self.blocks:
            at, self.seek = find_from(_START, text, self.seek, len(START))
            if at < 0:
                held = 0 if final else held_back(text[max(self.start, k - len(START) + 1):], START)
                return k - held, [], 0, 0
            self.content_end = at
            self._append(at + len(START))
        changed = len(self.blocks) - 1   # the last block reads on; those before it change only as they close
        for block, _ in sorted(self.open.feed(text), key=lambda closed: closed[0].index):
            if block.index < len(self.blocks) and self.blocks[block.index] is block and \
                    block.scanner.object_closed(text):
                # a call: the blocks after it were read inside it, and are read again from its end
                del self.blocks[block.index + 1:], self.calls[block.index + 1:]
                self.open.keep(lambda other: other.index < block.index)
                changed = min(changed, block.index)
        while True:
            block = self.blocks[-1]
            following = block.update(text)
            self.calls[-1] = block.call(final)
            if following < 0 or len(self.blocks) == MAX_TOOL_CALLS:
                break
            value = block.scanner.detach()   # an open call's object may still close
            if value is not None:
                self.open.add(value, block)
            self._append(following + len(START))
        while self.settled < len(self.blocks) and self.blocks[self.settled].settled():
            self.settled += 1
        if final:   # a call closed but never ended by its tag is complete at the end of the text
            self.calls[:] = [block.call(final) for block in self.blocks]
        return self.content_end, self.calls, self.settled, changed

    def _append(self, body: int) -> None:
        self.blocks.append(_Block(len(self.blocks), body))
        self.calls.append(PartialCall())


class _Block:
    """One `<tool_call>` block of HermesToolParser.parse, from its body on."""

    def __init__(self, index: int, body: int) -> None:
        self.index, self.body = index, body
        self.scanner = CallScanner(body)
        self.found = PartialCall()
        self.closed = False
        # the text after the call (parse's `rest`) begins at its end, or at an end tag inside an
        # open one: the first end tag from the body (open) or the rest (closed), and the following
        # block's tag from the rest
        self.end_at, self.end_seek = -1, body
        self.next_at, self.next_seek = -1, body
        # an open call's arguments less a tail that may yet become its end tag, while none is written
        self.short: PartialCall | None = None

    def update(self, text: str) -> int:
        """Where the following block's tag begins, or -1 while none is written. Once it is, the
        call and whether its end tag comes first are settled (an end tag before it would be found
        by now), unless an open call's object closes."""
        call, end = self.scanner.update(text)
        self.short = None
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
                self.found, self.short = call, _short_of_end_tag(text, self.body, call)
                return -1
        elif self.end_at < 0:
            self.end_at, self.end_seek = find_from(_END, text, self.end_seek, len(END))
        if self.next_at < 0:
            self.next_at, self.next_seek = find_from(_START, text, self.next_seek, len(START))
        return self.next_at

    def call(self, final: bool) -> PartialCall:
        ended = self.end_at >= 0 and (self.next_at < 0 or self.end_at < self.next_at)
        found = self.found if final or self.short is None else self.short
        return PartialCall(found.name, found.arguments, found.complete and (ended or final))

    def settled(self) -> bool:
        return self.closed and self.next_at >= 0


def _short_of_end_tag(text: str, body: int, call: PartialCall) -> PartialCall | None:
    """`call` (open, its block's end tag not written) as `parse` reads it before the text's tail
    that may yet grow into that tag: its arguments end before that tail and the spaces before it
    (parse strips an open value's trailing spaces). None when the tail cuts nothing."""
    k = len(text)
    held = held_back(text[max(body, k - len(END) + 1):], END)
    if not held or not isinstance(call.arguments, tuple) or call.arguments[1] <= k - held:
        return None
    begin, end = call.arguments[0], k - held
    while end > begin and text[end - 1].isspace():
        end -= 1
    return PartialCall(call.name, (begin, max(begin, end)), call.complete)
