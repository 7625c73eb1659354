"""Hermes format (Qwen2.5, Qwen3, Hermes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call, after optional content."""

from __future__ import annotations

from nanoserve.server.tool_parsers.base import Parsed, ToolParser, scan_call, without_marker_start

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(START)
        if first < 0:
            return Parsed(without_marker_start(text, START, final))
        parsed = Parsed(text[:first])  # as streamed: the same content whole or in deltas
        for block in text[first:].split(START)[1:]:
            body = block.split(END, 1)[0]
            call, _ = scan_call(body)
            call.complete = call.complete and (END in block or final)
            parsed.calls.append(call)
        return parsed
