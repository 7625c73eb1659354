"""Mistral format (7B v0.3, Nemo, Small): content, then `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.
`[TOOL_CALLS]` is a special token, so such requests keep special tokens in the text."""

from __future__ import annotations

import random
import string

from nanoserve.server.tool_parsers.base import Parsed, ToolParser, scan_call_list, without_marker_start

MARKER = "[TOOL_CALLS]"


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
