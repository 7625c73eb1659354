"""Reasoning parsers: split a model's thinking from its answer (`--reasoning-parser`)."""

from __future__ import annotations

from nanoserve.server.tool_parsers.base import without_marker_start


class Qwen3ReasoningParser:
    """Qwen3: an output that opens with `<think>` reasons until `</think>`; the rest is the answer.

    An output that does not open with `<think>` (thinking off, `enable_thinking: false`) is all answer.
    `parse` may be called on partial text (`final` False): what could still be a tag is held back.
    """

    name = "qwen3"
    START, END = "<think>", "</think>"

    def parse(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None, content)."""
        body = text.lstrip()
        if not body.startswith(self.START):
            if not final and self.START.startswith(body):
                return None, ""  # may yet open with <think>
            return None, text
        inner = body[len(self.START):]
        end = inner.find(self.END)
        if end < 0:
            return without_marker_start(inner, self.END, final), ""
        return inner[:end], inner[end + len(self.END):]


REASONING_PARSERS = {p.name: p for p in (Qwen3ReasoningParser,)}
