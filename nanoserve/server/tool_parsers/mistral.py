"""Mistral format (7B v0.3, Nemo, Small): content, then `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.
`[TOOL_CALLS]` is a special token, so such requests keep special tokens in the text."""

from __future__ import annotations

from nanoserve.server.tool_parsers.base import Parsed, ToolParser, held_back, scan_call_list

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(MARKER)
        if at < 0:
            keep = len(text) if final else len(text) - held_back(text, MARKER)
            return Parsed(text[:keep])
        rest = text[at + len(MARKER):].lstrip()
        if rest.startswith("["):
            rest = rest[1:]
        calls, _ = scan_call_list(rest.rstrip().removesuffix("]") if final else rest)
        return Parsed(text[:at], calls)  # as streamed: the same content whole or in deltas
