"""Llama 3.1 / 3.2 JSON format: the reply is `{"name": ..., "parameters": {...}}` (several joined
by `; `), optionally after `<|python_tag|>`; a reply that starts otherwise is content."""

from __future__ import annotations

from nanoserve.server.tool_parsers.base import Parsed, ToolParser, scan_call_list

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
