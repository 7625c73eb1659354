"""Reasoning parsers: split a model's thinking from its answer (`--reasoning-parser`)."""

from __future__ import annotations

from nanoserve.server.tool_parsers.base import without_marker_start


class Qwen3ReasoningParser:
    """Qwen3: an output that opens with `<think>` reasons until `</think>`; the rest is the answer.

    An output that does not open with `<think>` (thinking off, `enable_thinking: false`) is all answer,
    unless the prompt itself ends inside an opened `<think>` (templates that open it for the model):
    then the output starts in its reasoning. `parse` may be called on partial text (`final` False):
    what could still be a tag is held back.
    """

    name = "qwen3"
    START, END = "<think>", "</think>"

    def __init__(self, opened_in_prompt: bool = False) -> None:
        self.opened_in_prompt = opened_in_prompt

    @classmethod
    def opens_in(cls, prompt_tail: str) -> bool:
        """Whether a prompt ending with this text leaves a `<think>` open for the output."""
        return prompt_tail.rfind(cls.START) > prompt_tail.rfind(cls.END)

    def parse(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None, content)."""
        body = text.lstrip()
        if self.opened_in_prompt and not body.startswith(self.START):
            body = self.START + body
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
