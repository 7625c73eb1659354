"""One chat choice's text turned into an OpenAI message: reasoning, content and tool calls,
whole or as stream deltas. Reasoning is split first; tool calls are read from what remains."""

from __future__ import annotations

import logging

from nanoserve.server.reasoning import Qwen3ReasoningParser
from nanoserve.server.tool_parsers import Parsed, PartialCall
from nanoserve.server.tool_parsers.base import scan_call_list, scan_calls
from nanoserve.server.tools import ToolPlan, tool_call_id

logger = logging.getLogger(__name__)


class ChoiceReader:
    """Reads one choice. `message()` for a whole response; `delta()` for each streamed update."""

    def __init__(self, plan: ToolPlan, reasoning: Qwen3ReasoningParser | None, include_reasoning: bool = True) -> None:
        """include_reasoning False: the parsed reasoning is dropped, not sent (vLLM's field)."""
        self.plan, self.reasoning, self.include_reasoning = plan, reasoning, include_reasoning
        self.text = ""
        self.sent_reasoning, self.sent_content = 0, 0
        self.ids: list[str] = []       # per streamed call: its id, sent with its name
        self.sent_args: list[str] = []
        # a required call list as far as its calls are closed: (its text to there, those calls)
        self.closed_calls: tuple[str, list[PartialCall]] = ("", [])

    def parse(self, text: str, final: bool) -> tuple[str | None, str, Parsed]:
        """(reasoning or None, the text after it, its content and calls)."""
        reasoning, content = self.reasoning.parse(text, final) if self.reasoning else (None, text)
        return reasoning, content, self._calls(content, final)

    def _calls(self, content: str, final: bool) -> Parsed:
        try:
            return self._read_calls(content, final)
        except Exception:  # the model's text broke a parser: it is the answer's content, not an error
            logger.exception("tool-call parsing failed; the text is returned as content")
            return Parsed(content)

    def _read_calls(self, content: str, final: bool) -> Parsed:
        mode = self.plan.mode
        if mode == "auto":
            return self.plan.parser.parse(content, final)
        if mode == "named":
            return Parsed("", [PartialCall(self.plan.function, content, final)])
        if mode == "required":
            body = content.lstrip()
            return Parsed("", self._required_calls(body[1:] if body.startswith("[") else "", final))
        return Parsed(content)

    def _required_calls(self, body: str, final: bool) -> list[PartialCall]:
        """The calls of a required list. Streamed, its closed calls are read once: read again at
        every update, 300 of them took 3.6 s of the event loop over one choice."""
        if final:
            return scan_call_list(body)
        seen, closed = self.closed_calls
        if not body.startswith(seen):   # the text is not the last one grown: read it all
            seen, closed = "", []
        calls, end, count = scan_calls(body, len(seen), after_call=bool(closed))
        self.closed_calls = (body[:end], closed + calls[:count])
        return closed + calls

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole message and the finish reason ("tool_calls" when the model called)."""
        reasoning, content, parsed = self.parse(text, final=True)
        # ended inside a call (max_tokens, a stop string or token): the call as far as it got, as
        # OpenAI returns it and as the stream announced it once its name was written
        calls = [c for c in parsed.calls if c.complete or c.name is not None]
        message: dict = {"role": "assistant", "content": parsed.content or None}
        if reasoning is not None and self.include_reasoning:
            # vLLM's current name, and the older one that DeepSeek-style clients read
            message["reasoning"] = message["reasoning_content"] = reasoning
        if not calls:
            # no whole call: whatever was written is the answer; an empty one is "" as streamed (and
            # as vLLM returns it), null only beside reasoning, as vLLM's reasoning parsers leave it
            message["content"] = content or (None if reasoning is not None else "")
            return message, finish_reason
        message["tool_calls"] = [{"id": tool_call_id(self.plan.parser), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message, self.finish_reason(finish_reason, called=True)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        # OpenAI answers "stop" when the caller named the function, "tool_calls" when the model chose to call
        return "tool_calls" if reason == "stop" and called and self.plan.mode != "named" else reason

    def delta(self, new_text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """What this update adds to the streamed message, and the finish reason to send with it."""
        if not self.plan.active and self.reasoning is None:
            return ({"content": new_text} if new_text else {}), finish_reason   # plain text: nothing to parse
        self.text += new_text
        final = finish_reason is not None
        reasoning, content, parsed = self.parse(self.text, final)
        delta: dict = {}
        if reasoning is not None and self.include_reasoning and len(reasoning) > self.sent_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning[self.sent_reasoning:]
            self.sent_reasoning = len(reasoning)
        answer = parsed.content
        if final and self.plan.active and not self.ids and not any(c.complete for c in parsed.calls):
            # no call came of it: what was held back as a possible call is content, as in message()
            answer = content
        if len(answer) > self.sent_content:
            delta["content"] = answer[self.sent_content:]
            self.sent_content = len(answer)
        tool_deltas = self._call_deltas(parsed.calls)
        if tool_deltas:
            delta["tool_calls"] = tool_deltas
        return delta, self.finish_reason(finish_reason, called=bool(self.ids))

    def _call_deltas(self, calls: list[PartialCall]) -> list[dict]:
        """OpenAI's order: a call's index, id and name first, then fragments of its arguments; one
        entry per call in a delta (the first carries whatever arguments have come with it)."""
        out = []
        for i, call in enumerate(calls):
            if call.name is None:
                break  # a call is announced by its name; the ones after it wait
            entry: dict = {"index": i, "function": {}}
            if i == len(self.ids):
                self.ids.append(tool_call_id(self.plan.parser))
                self.sent_args.append("")
                entry = {"index": i, "id": self.ids[i], "type": "function",
                         "function": {"name": call.name, "arguments": ""}}
            sent = self.sent_args[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                entry["function"]["arguments"] = call.arguments[len(sent):]
                self.sent_args[i] = call.arguments
            if entry["function"]:
                out.append(entry)
        return out
