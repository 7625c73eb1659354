"""Hermes format (Qwen2.5, Qwen3, Hermes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call, after optional content."""

from __future__ import annotations

from nanoserve.server.tool_parsers.base import Parsed, ToolParser, scan_call, without_marker_start

START, END = "<tool_call>", "</tool_call>"


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
