"""Llama 3.1 / 3.2 JSON format: the reply is `{"name": ..., "parameters": {...}}` (several joined
by `; `), optionally after `<|python_tag|>`; a reply that starts otherwise is content."""

from __future__ import annotations

from nanoserve.server.tool_parsers.base import _WHITESPACE, Parsed, PartialCall, ToolParser, scan_call_list
from nanoserve.server.tool_parsers.stream import ListScanner

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):]
        elif not final and PYTHON_TAG.startswith(body):
            return Parsed()  # nothing, or the start of the tag: too early to tell
        if not body.lstrip().startswith("{"):
            return Parsed(text if final or body.strip() else "")
        calls = scan_call_list(body, ";")
        if final and calls[0].name is None:
            return Parsed(text)  # JSON that is not a call is an answer
        # a call is streamed once its name is written: from then on the reply is calls, whatever follows
        return Parsed("", calls)

    def stream(self, start: int) -> Llama3JsonStream:
        return Llama3JsonStream(start)


class Llama3JsonStream:
    """`parse` of text[start:] as the text grows: the reply's opening decides once whether it is
    content or calls; the calls are read on."""

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.body = -1          # where the reply begins after the tag, once that is known
        self.content = False    # the reply is content: all of the text
        self.calls: ListScanner | None = None

    def update(self, text: str, final: bool) -> tuple[int, list[PartialCall], int, int]:
        k = len(text)
        if self.calls is None and not self.content:
            if self.body < 0:
                self.pos = _WHITESPACE.match(text, self.pos).end()
                opening = text[self.pos:self.pos + len(PYTHON_TAG)]
                if opening == PYTHON_TAG:
                    self.body = self.pos + len(PYTHON_TAG)
                elif not PYTHON_TAG.startswith(opening):
                    self.body = self.pos
                elif not final:
                    return self.start, [], 0, 0   # nothing, or the start of the tag: too early to tell
            first = _WHITESPACE.match(text, max(self.body, self.pos)).end()
            if first == k or text[first] != "{":
                self.content = first < k   # text that is not a call: the reply is content
                return (k if final or first < k else self.start), [], 0, 0
            self.calls = ListScanner(self.body, ";")
        if self.content:
            return k, [], 0, 0
        calls, settled, changed = self.calls.update(text)
        if final and calls[0].name is None:
            return k, [], 0, 0   # JSON that is not a call is an answer
        return self.start, calls, settled, changed
