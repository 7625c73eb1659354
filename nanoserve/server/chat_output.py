"""One chat choice's text turned into an OpenAI message: reasoning, content and tool calls,
whole or as stream deltas. Reasoning is split first; tool calls are read from what remains."""

from __future__ import annotations

import itertools
import json
import logging

from nanoserve.server.reasoning import Qwen3ReasoningParser
from nanoserve.server.tool_parsers import Parsed, PartialCall
from nanoserve.server.tool_parsers.base import _WHITESPACE, CallStream, Span, scan_call_list
from nanoserve.server.tool_parsers.stream import ListScanner
from nanoserve.server.tools import ToolPlan, tool_call_id

logger = logging.getLogger(__name__)


class ChoiceReader:
    """Reads one choice. `message()` for a whole response; `delta()` for each streamed update."""

    def __init__(self, plan: ToolPlan, reasoning: Qwen3ReasoningParser | None, include_reasoning: bool = True) -> None:
        """include_reasoning False: the parsed reasoning is dropped, not sent (vLLM's field)."""
        self.plan, self.reasoning, self.include_reasoning = plan, reasoning, include_reasoning
        # the streamed text: this attribute is its only reference while it grows (see delta)
        self.text = ""
        self.split = reasoning.stream() if reasoning is not None else None
        self.calls: CallStream | None = None   # reads the content for calls once it is known to begin
        self.broken = False   # `calls` failed: the content is parsed whole at each update instead
        self.sent_reasoning, self.sent_content = 0, 0
        self.ids: list[str] = []       # per streamed call: its id, sent with its name
        self.sent_args: list[str | Span] = []
        self.done = 0   # leading calls that no later text changes, all they have is sent: not read again
        self.stopped = 0   # where the last update stopped reading calls: a call with no name yet, or the end

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
            return Parsed("", scan_call_list(body[1:] if body.startswith("[") else ""))
        return Parsed(content)

    def message(self, text: str, finish_reason: str | None, stop_string: bool = False) -> tuple[dict, str | None]:
        """The whole message and the finish reason ("tool_calls" when the model called);
        `stop_string`: a stop string ended the text, not the model."""
        reasoning, content, parsed = self.parse(text, final=True)
        calls = announced(parsed.calls)[:1 if self.plan.single else None]
        whole = runnable(text, calls)
        if self.plan.mode == "auto" and finish_reason == "stop" and not stop_string and not whole:
            # the model ended its text with a call that is no JSON object (`{"city": }`): no call a
            # client can run (json.loads, the openai client's parse() raised), so the text is the
            # answer, as vLLM's parsers return it. A call cut short by max_tokens or a stop string
            # stays one, as far as it got, as OpenAI returns it. A stream has sent its deltas
            calls = []
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
        return message, self.finish_reason(finish_reason, called=whole)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI answers "stop" when the caller named the function, "tool_calls" when the model
        chose to call. `called`: every call the reply carries is whole; one cut short by a stop
        string or the end of the text is no call a client can run, and the reason stays "stop"."""
        return "tool_calls" if reason == "stop" and called and self.plan.mode != "named" else reason

    def delta(self, new_text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """What this update adds to the streamed message, and the finish reason to send with it.
        Equal to the difference between parses of the text so far, but each update reads only what
        is new: parsed whole each time, a 150 kB output cost O(n^2), 16 s of the event loop."""
        if not self.plan.active and self.reasoning is None:
            return ({"content": new_text} if new_text else {}), finish_reason   # plain text: nothing to parse
        # with no other reference, CPython appends in place; `self.text += new_text` copied the whole
        # text at every update (a 1 MB output: 32 s of copying)
        text, self.text = self.text, ""
        text += new_text
        self.text = text
        final = finish_reason is not None
        reasoning, start = self.split.update(text, final) if self.split is not None else (None, 0)
        begin = len(text) if start is None else start   # the content is text[begin:], or "" (begin = len)
        content_end, calls, settled, changed = self._stream_calls(text, start, final)
        if self.plan.single:   # the first call alone is sent, as message() keeps it alone
            calls, settled, changed = calls[:1], min(settled, 1), min(changed, 1)
        delta: dict = {}
        if reasoning is not None and self.include_reasoning and reasoning[1] - reasoning[0] > self.sent_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = text[reasoning[0] + self.sent_reasoning:reasoning[1]]
            self.sent_reasoning = reasoning[1] - reasoning[0]
        if final and self.plan.active and not self.ids and not announced(calls):
            # no call came of it: what was held back as a possible call is content, as in message()
            content_end = len(text)
        if content_end - begin > self.sent_content:
            delta["content"] = text[begin + self.sent_content:content_end]
            self.sent_content = content_end - begin
        tool_deltas = self._call_deltas(text, calls, settled, changed)
        if tool_deltas:
            delta["tool_calls"] = tool_deltas
        # (a helper's loop, not a generator here: one that read `text` would make it a closure cell,
        # and `text += new_text` above would then copy the whole text at every update)
        whole = final and runnable(text, announced(calls)[:len(self.ids)])
        return delta, self.finish_reason(finish_reason, called=bool(self.ids) and whole)

    def _stream_calls(self, text: str, start: int | None, final: bool) -> tuple[int, list[PartialCall], int, int]:
        """CallStream.update for the content: text[start:], or "" while start is None."""
        if start is None:   # the reasoning goes on: the content is "" (a named call is announced already)
            return len(text), self._calls("", final).calls, 0, 0
        if self.calls is None:
            mode = self.plan.mode
            self.calls = (self.plan.parser.stream(start) if mode == "auto" else
                          _NamedStream(self.plan.function, start) if mode == "named" else
                          _RequiredStream(start) if mode == "required" else _ContentStream())
        if not self.broken:
            try:
                return self.calls.update(text, final)
            except Exception:   # a fault of the stream reader's: the whole parse still answers
                logger.exception("streamed tool-call reading failed; the content is parsed whole from now on")
                self.broken = True
        parsed = self._calls(text[start:], final)
        return start + len(parsed.content), parsed.calls, 0, 0

    def _call_deltas(self, text: str, calls: list[PartialCall], settled: int, changed: int) -> list[dict]:
        """OpenAI's order: a call's index, id and name first, then fragments of its arguments; one
        entry per call in a delta (the first carries whatever arguments have come with it). The
        calls before `changed` are as they were, all sent up to where the last update stopped:
        read on from there (crafted output keeps up to MAX_TOOL_CALLS calls open, never settled)."""
        out, begin = [], max(self.done, min(changed, self.stopped))
        self.stopped = len(calls)
        for i in range(begin, len(calls)):
            call = calls[i]
            if call.name is None:
                self.stopped = i
                break  # a call is announced by its name; the ones after it wait
            entry: dict = {"index": i, "function": {}}
            if i == len(self.ids):
                self.ids.append(tool_call_id(self.plan.parser))
                self.sent_args.append("")
                entry = {"index": i, "id": self.ids[i], "type": "function",
                         "function": {"name": call.name, "arguments": ""}}
            added = _added(text, self.sent_args[i], call.arguments)
            if added:
                entry["function"]["arguments"] = added
                self.sent_args[i] = call.arguments
            if entry["function"]:
                out.append(entry)
        self.done = max(self.done, min(settled, len(self.ids)))
        return out


def whole_arguments(arguments: str) -> bool:
    """Whether a call's arguments are a whole JSON object, as a client that runs the call reads them
    (json.loads, which takes a lone surrogate's escape where orjson does not; not its NaN and
    Infinity, which JSON does not have and strict parsers refuse)."""
    try:
        return isinstance(json.loads(arguments, parse_constant=_no_constant), dict)
    except ValueError:
        return False


def runnable(text: str, calls: list[PartialCall]) -> bool:
    """Whether every call's arguments (text spans of a stream, or strings) are a whole JSON object."""
    return all(whole_arguments(_text(text, call.arguments)) for call in calls)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def announced(calls: list[PartialCall]) -> list[PartialCall]:
    """The calls a reply carries: the leading ones that name their function, as a stream announces
    them (by name, in order, each after the one before). A call cut off after its name (max_tokens,
    a stop string) is one, as far as it got, as OpenAI returns it; one cut off before its name, or
    an object that names no function, is not, nor are the calls after it: a whole reply and its
    stream then hold the same calls, and the same content."""
    return list(itertools.takewhile(lambda call: call.name is not None, calls))


def _added(text: str, sent: str | Span, arguments: str | Span) -> str:
    """What `arguments` add to the `sent` ones: "" unless they are longer and start with them. Spans
    from one start are one growing string: compared without being copied out of the text."""
    if arguments is sent:
        return ""
    if isinstance(arguments, tuple) and isinstance(sent, tuple) and arguments[0] == sent[0]:
        return text[sent[1]:arguments[1]]
    sent, arguments = _text(text, sent), _text(text, arguments)
    return arguments[len(sent):] if len(arguments) > len(sent) and arguments.startswith(sent) else ""


def _text(text: str, arguments: str | Span) -> str:
    return text[arguments[0]:arguments[1]] if isinstance(arguments, tuple) else arguments


class _ContentStream:
    """tool_choice none (reasoning on): all of the content is content."""

    def update(self, text: str, final: bool) -> tuple[int, list[PartialCall], int, int]:
        return len(text), [], 0, 0


class _NamedStream:
    """A named function: the content is its arguments."""

    def __init__(self, function: str | None, start: int) -> None:
        self.function, self.start = function, start

    def update(self, text: str, final: bool) -> tuple[int, list[PartialCall], int, int]:
        return self.start, [PartialCall(self.function, (self.start, len(text)), final)], 0, 0


class _RequiredStream:
    """tool_choice required: the content is a JSON list of calls; each closed call is read once."""

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.list: ListScanner | None = None
        self.none = False   # the content does not open a list: no calls

    def update(self, text: str, final: bool) -> tuple[int, list[PartialCall], int, int]:
        if self.list is None and not self.none:
            self.pos = _WHITESPACE.match(text, self.pos).end()
            if self.pos < len(text):
                self.none = text[self.pos] != "["
                self.list = None if self.none else ListScanner(self.pos + 1)
        return self.start, *(self.list.update(text) if self.list is not None else ([], 0, 0))
