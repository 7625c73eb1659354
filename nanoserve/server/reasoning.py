"""Reasoning parsers: split a model's thinking from its answer (`--reasoning-parser`)."""

from __future__ import annotations

import re

from nanoserve.server.tool_parsers.base import _WHITESPACE, Span, held_back, without_marker_start
from nanoserve.server.tool_parsers.stream import find_from


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

    @classmethod
    def closes_in(cls, prompt_tail: str) -> bool:
        """Whether a prompt ending with this text has closed the reasoning (an empty block written for
        the model, as Qwen3's template does with enable_thinking false): the output is all answer."""
        return prompt_tail.rfind(cls.END) > prompt_tail.rfind(cls.START)

    def parse(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None, content)."""
        body = text.lstrip()
        if not final and len(body) < len(self.START) and self.START.startswith(body):
            # may yet open with <think>, which is no reasoning of its own even where the prompt opened
            # one: a "<th" read as reasoning now would not be a prefix of the reasoning once "ink>" came
            return None, ""
        if self.opened_in_prompt and not body.startswith(self.START):
            body = self.START + body
        if not body.startswith(self.START):
            return None, text
        inner = body[len(self.START):]
        end = inner.find(self.END)
        if end < 0:
            return without_marker_start(inner, self.END, final), ""
        return inner[:end], inner[end + len(self.END):]

    def stream(self) -> Qwen3ReasoningStream:
        return Qwen3ReasoningStream(self.opened_in_prompt)


class Qwen3ReasoningStream:
    """`Qwen3ReasoningParser.parse` as the text grows, in spans of it: the opening is read until it
    is known, then `</think>` is searched for from where the last update left off."""

    START, END = Qwen3ReasoningParser.START, Qwen3ReasoningParser.END

    def __init__(self, opened_in_prompt: bool) -> None:
        self.opened = opened_in_prompt
        self.lead = 0        # where the text's first non-space character is (or will be)
        self.inner = -1      # where the reasoning begins, once known
        self.decided = False  # the opening is known (it can no longer become `<think>`)
        self.answer = False   # no reasoning: all of the text is content
        self.end, self.seek = -1, 0   # where `</think>` begins; no `</think>` begins before seek

    def update(self, text: str, final: bool) -> tuple[Span | None, int | None]:
        """(the reasoning's span, or None; where the content starts, or None while it is "")."""
        if not self.decided:
            self.lead = _WHITESPACE.match(text, self.lead).end()
            opening = text[self.lead:self.lead + len(self.START)]
            self.decided = not self.START.startswith(opening) or opening == self.START
            if opening == self.START:
                self.inner = self.lead + len(self.START)
            elif not (self.decided or final):
                # may yet open with <think>, which is no reasoning of its own, even where the prompt
                # opened one: a "<th" sent as reasoning could not be taken back once "ink>" came
                return None, None
            elif self.opened:   # the prompt opened it: the output starts inside it
                self.inner = self.lead
            elif self.decided:
                self.answer = True
            else:
                return None, 0   # it ends without opening: all of it is the answer
        if self.answer:
            return None, 0
        k = len(text)
        if self.end < 0:
            self.end, self.seek = find_from(_THINK_END, text, max(self.seek, self.inner), len(self.END))
        if self.end >= 0:
            return (self.inner, self.end), self.end + len(self.END)
        held = 0 if final else held_back(text[max(self.inner, k - len(self.END) + 1):], self.END)
        return (self.inner, k - held), None


class DeepSeekR1ReasoningParser(Qwen3ReasoningParser):
    """DeepSeek-R1 and its distills (Qwen2 and Llama models): the output starts in its reasoning,
    `<think>` or not, and reasons until `</think>`; an output without it is all reasoning, as vLLM's
    deepseek_r1 parser reads it. A prompt whose template closed the reasoning (thinking turned
    off) leaves the output all answer."""

    name = "deepseek_r1"

    @classmethod
    def opens_in(cls, prompt_tail: str) -> bool:
        return not cls.closes_in(prompt_tail)


_THINK_END = re.compile(re.escape(Qwen3ReasoningParser.END))
REASONING_PARSERS = {p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}
