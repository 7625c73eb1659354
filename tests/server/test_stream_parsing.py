"""Streamed chat output is read incrementally: every update gives exactly what parsing the whole
text so far gives, and costs in proportion to what it adds, not to what came before it."""

from __future__ import annotations

import json
import random
import re
import tracemalloc
from json import JSONDecodeError
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.server import chat_output, reasoning
from nanoserve.server.chat_output import ChoiceReader
from nanoserve.server.reasoning import Qwen3ReasoningParser
from nanoserve.server.tool_parsers import TOOL_PARSERS, base, hermes, llama3_json, mistral, pythonic, stream
from nanoserve.server.tool_parsers.base import scan_call_list
from nanoserve.server.tool_parsers.stream import ListScanner
from nanoserve.server.tools import ToolPlan

# hermes blocks each left open, the next inside its string or object
NESTED = ['<tool_call>{"a": "</tool_call>', '<tool_call>{"name": "f", "arguments": "</tool_call>',
          '<tool_call>{"a": [</tool_call>', '<tool_call>{"a": "\\"</tool_call>']
# pieces of the formats, whole and cut, and of JSON at its edges: escapes, nested brackets, keys
# inside strings, numbers and words, broken escapes, lone surrogates
FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "</tool", "call>", "[TOOL_CALLS]", "[TOOL", "<|python_tag|>", "<|python",
    "<think>", "</think>", "<thi", "</thi", "nk>", "{", "}", "[", "]", '"', "\\", '\\"', '"name"', '"name": "f"', ": ",
    ":", '"arguments"', '"parameters"', '"arguments": ', ",", ";", " ", "\n", "\t", "1", "-", "12.5", "null", "tru",
    "e", "abc", "x y", "é", "\\u12", "\\ud800", '{"name": "f", "arguments": {"a": 1}}', '{"a": "b"}', '"x, {y}"',
    '{"name": "g", "parameters": {"b": [1, {"c": "}"}]}}', "\\n", '"\\\\"', "</tool_call>\n<tool_call>\n",
    '{"arguments": {"name": "inner"}, "name": "outer"}', '"html": "a </tool_call> b"', "\\\n",
    # crafted: blocks opened inside open calls (in a string, in an object), bare numbers
    NESTED[0], NESTED[1], NESTED[2], "123", "1.", "e5", "-I", "nfinity",
    # pythonic calls: names, keywords, Python literals and strings (triple-quoted too), cut anywhere
    "[f(", "get_weather(", "a=", "city='Paris'", "x=[1, (2, 3)]", "'" * 3, "'", "d={'k': None}", ")", "), ", "=",
    "(", "True", "'it''s'", '"' * 3 + "a" + '"' * 3, "b'x'", "f(1)", "[g(b=2)]"]
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join)
cuts = st.lists(st.integers(0, 9), min_size=1, max_size=60)
PLANS = {"none": lambda: ToolPlan(), "required": lambda: ToolPlan("required"),
         "named": lambda: ToolPlan("named", function="f"),
         **{name: lambda name=name: ToolPlan("auto", TOOL_PARSERS[name]()) for name in TOOL_PARSERS}}
REASONING = {"off": lambda: None, "on": Qwen3ReasoningParser, "opened": lambda: Qwen3ReasoningParser(True)}
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


class WholeReader:
    """ChoiceReader.delta as it was: the whole text parsed again at every update (the specification)."""

    def __init__(self, reader: ChoiceReader) -> None:
        self.reader, self.text = reader, ""
        self.sent_reasoning = self.sent_content = self.announced = 0
        self.sent_args: list[str] = []

    def delta(self, new_text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        r = self.reader
        if not r.plan.active and r.reasoning is None:
            return ({"content": new_text} if new_text else {}), finish_reason
        self.text += new_text
        final = finish_reason is not None
        thought, content, parsed = r.parse(self.text, final)
        delta: dict = {}
        if thought is not None and r.include_reasoning and len(thought) > self.sent_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = thought[self.sent_reasoning:]
            self.sent_reasoning = len(thought)
        answer = parsed.content
        if final and r.plan.active and not self.announced and not chat_output.announced(parsed.calls):
            answer = content
        if len(answer) > self.sent_content:
            delta["content"] = answer[self.sent_content:]
            self.sent_content = len(answer)
        entries = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break
            entry: dict = {"index": i, "function": {}}
            if i == self.announced:
                self.announced += 1
                self.sent_args.append("")
                entry = {"index": i, "id": "ID", "type": "function", "function": {"name": call.name, "arguments": ""}}
            sent = self.sent_args[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                entry["function"]["arguments"] = call.arguments[len(sent):]
                self.sent_args[i] = call.arguments
            if entry["function"]:
                entries.append(entry)
        if entries:
            delta["tool_calls"] = entries
        # "tool_calls" only when every call sent is whole (a stop string inside one leaves "stop")
        whole = all(chat_output.whole_arguments(c.arguments) for c in chat_output.announced(parsed.calls)[:self.announced])
        return delta, r.finish_reason(finish_reason, called=bool(self.announced) and whole)


def pieces(text: str, sizes: list[int]) -> list[str]:
    """`text` cut at the given sizes, in turn (0: an update that adds nothing); the last piece
    is empty at times, as when a finish comes alone."""
    out, pos = [], 0
    for size in sizes * (len(text) // max(sum(sizes), 1) + 1):
        out.append(text[pos:pos + size])
        pos += size
        if pos >= len(text):
            break
    return out + [text[pos:]] * (pos < len(text)) + [""] * (sizes[0] == 0)


def without_ids(delta: dict) -> dict:
    for entry in delta.get("tool_calls", []):
        if "id" in entry:
            entry["id"] = "ID"
    return delta


def materialized(text: str, calls: list) -> list[tuple]:
    return [(c.name, chat_output._text(text, c.arguments), c.complete) for c in calls]


@pytest.mark.parametrize("thinking", sorted(REASONING))
@pytest.mark.parametrize("plan", sorted(PLANS))
@SETTINGS
@given(text=texts, sizes=cuts, finish=st.sampled_from(["stop", "length"]))
def test_each_streamed_update_is_what_parsing_the_whole_text_so_far_sends(plan, thinking, text, sizes, finish):
    streamed = ChoiceReader(PLANS[plan](), REASONING[thinking](), include_reasoning=thinking != "opened")
    whole = WholeReader(ChoiceReader(PLANS[plan](), REASONING[thinking](), streamed.include_reasoning))
    updates = pieces(text, sizes)
    for i, piece in enumerate(updates):
        reason = finish if i == len(updates) - 1 else None
        delta, finish_reason = streamed.delta(piece, reason)
        assert (without_ids(delta), finish_reason) == whole.delta(piece, reason), updates[:i + 1]


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@SETTINGS
@given(lead=st.sampled_from(["", "ab ", "<think>x</think>"]), text=texts, sizes=cuts, final=st.booleans())
def test_a_parser_stream_at_every_update_equals_its_parse_of_the_text_so_far(parser, lead, text, sizes, final):
    """Content and calls alike, from wherever the content starts in the text (after the reasoning)."""
    assert_stream_is_parse(parser, lead, text, sizes, final)


def assert_stream_is_parse(parser: str, lead: str, text: str, sizes: list[int], final: bool) -> None:
    whole, reader = TOOL_PARSERS[parser](), TOOL_PARSERS[parser]().stream(len(lead))
    so_far = lead
    for piece in pieces(text, sizes):
        so_far += piece
        end, calls, *_ = reader.update(so_far, False)
        expected = whole.parse(so_far[len(lead):], False)
        assert (so_far[len(lead):end], materialized(so_far, calls)) == \
            (expected.content, materialized(so_far, expected.calls)), so_far
    end, calls, *_ = reader.update(so_far, final)
    expected = whole.parse(so_far[len(lead):], final)
    assert (so_far[len(lead):end], materialized(so_far, calls)) == \
        (expected.content, materialized(so_far, expected.calls))


@SETTINGS
@given(text=texts, sizes=cuts, separator=st.sampled_from([",", ";"]), opened=st.booleans())
def test_call_lists_and_reasoning_read_incrementally_equal_their_whole_reading(text, sizes, separator, opened):
    parser = Qwen3ReasoningParser(opened)
    calls, split = ListScanner(0, separator), parser.stream()
    so_far = ""
    for piece in pieces(text, sizes):
        so_far += piece
        assert materialized(so_far, calls.update(so_far)[0]) == materialized(so_far, scan_call_list(so_far, separator))
        for final in (False, True):
            span, start = split.update(so_far, final)
            assert (None if span is None else so_far[span[0]:span[1]], "" if start is None else so_far[start:]) == \
                parser.parse(so_far, final), so_far


def max_tool_calls(n: int):
    """MAX_TOOL_CALLS lowered, so that short texts reach it."""
    patches = [mock.patch.object(module, "MAX_TOOL_CALLS", n) for module in (base, stream, hermes, pythonic)]
    for patch in patches:
        patch.start()
    return patches


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@SETTINGS
@given(text=texts, sizes=cuts, separator=st.sampled_from([",", ";"]), final=st.booleans())
def test_streams_equal_their_parse_past_max_tool_calls(parser, text, sizes, separator, final):
    """Calls past the bound are not read, alike in a parse and in a stream (blocks, lists)."""
    patches = max_tool_calls(2)
    try:
        assert_stream_is_parse(parser, "", text, sizes, final)
        calls, so_far = ListScanner(0, separator), ""
        for piece in pieces(text, sizes):
            so_far += piece
            assert materialized(so_far, calls.update(so_far)[0]) == materialized(so_far, scan_call_list(so_far, separator))
    finally:
        for patch in patches:
            patch.stop()


@pytest.mark.parametrize("seed", range(4))
def test_hundreds_of_nested_hermes_blocks_stream_what_the_whole_parse_sends(seed):
    """More blocks than MAX_TOOL_CALLS, opened inside each other's strings and objects, some of
    them closing later (so that the blocks after them are read again), in long updates."""
    rng = random.Random(seed)
    closers = ['"}', "]}", "}", '"', "\\", " x ", '<tool_call>{"name": "g", "arguments": {}}</tool_call>']
    text = "".join(rng.choice(NESTED * 3 + closers) for _ in range(500)) + "]} end"
    sizes = [rng.randint(1, 300) for _ in range(40)]
    assert_stream_is_parse("hermes", "", text, sizes, True)
    streamed = ChoiceReader(PLANS["hermes"](), None)
    whole = WholeReader(ChoiceReader(PLANS["hermes"](), None))
    updates = pieces(text, sizes)
    for i, piece in enumerate(updates):
        reason = "stop" if i == len(updates) - 1 else None
        delta, finish_reason = streamed.delta(piece, reason)
        assert (without_ids(delta), finish_reason) == whole.delta(piece, reason), i
    assert len(streamed.ids) <= base.MAX_TOOL_CALLS


def call_text(parser: str, calls: list[tuple[str, dict]], arguments_first: bool = False) -> str:
    """The calls in the parser's format; `arguments_first`: each object's arguments before its name."""
    key = "parameters" if parser == "llama3_json" else "arguments"
    objects = [{key: a, "name": n} if arguments_first else {"name": n, key: a} for n, a in calls]
    if parser == "hermes":
        return "".join(f'<tool_call>\n{json.dumps(o)}\n</tool_call>\n' for o in objects)
    if parser == "mistral":
        return "[TOOL_CALLS] " + json.dumps(objects)
    if parser == "pythonic":   # names and keywords must be identifiers; the values are Python literals
        return "[" + ", ".join(f"f{i}(" + ", ".join(f"k{j}={v!r}" for j, v in enumerate(a.values())) + ")"
                               for i, (_, a) in enumerate(calls)) + "]"
    return "<|python_tag|>" + "; ".join(json.dumps(o) for o in objects[:1])


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@SETTINGS
@given(thought=st.one_of(st.none(), st.text(max_size=40)), answer=st.text(max_size=40),
       calls=st.lists(st.tuples(st.text(min_size=1, max_size=8), st.dictionaries(
           st.one_of(st.just("name"), st.text(max_size=5)),
           st.one_of(st.text(max_size=30), st.integers(), st.lists(st.text(max_size=5), max_size=3)), max_size=3)),
           max_size=3),
       sizes=cuts, opened=st.booleans(), arguments_first=st.booleans())
def test_streamed_deltas_add_up_to_the_whole_message(parser, thought, answer, calls, sizes, opened, arguments_first):
    """Well-formed outputs: reasoning, content, calls in the parser's format (strings that hold
    quotes, brackets, escapes and tags among them). `opened`: the prompt left a <think> open, and
    the output may open its own all the same (streamed, a "<th" was sent as reasoning).
    `arguments_first`: a call's arguments, which may have a "name" of their own, before its name
    (streamed, that "name" was taken for the function's)."""
    marker = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "{", "pythonic": "["}[parser]
    if thought is not None and "</think>" in thought or marker in answer or parser in ("llama3_json", "pythonic") \
            and calls:
        answer = ""   # llama3_json, pythonic: a reply is calls or content, never both
    thinking = "" if thought is None else f"<think>{thought}</think>"
    text = thinking + answer + (call_text(parser, calls, arguments_first) if calls else "")
    plan = lambda: ToolPlan("auto", TOOL_PARSERS[parser]())  # noqa: E731
    message, _ = ChoiceReader(plan(), Qwen3ReasoningParser(opened)).message(text, "stop")
    reader = ChoiceReader(plan(), Qwen3ReasoningParser(opened))
    updates = pieces(text, sizes)
    deltas = [reader.delta(p, "stop" if i == len(updates) - 1 else None)[0] for i, p in enumerate(updates)]
    assert "".join(d.get("content", "") for d in deltas) == (message["content"] or "")
    assert "".join(d.get("reasoning", "") for d in deltas) == (message.get("reasoning") or "")
    streamed: dict[int, list[str]] = {}
    for entry in (e for d in deltas for e in d.get("tool_calls", [])):
        name, args = streamed.setdefault(entry["index"], ["", ""])
        streamed[entry["index"]] = [name + entry["function"].get("name", ""), args + entry["function"]["arguments"]]
    assert [streamed[i] for i in sorted(streamed)] == \
        [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls", [])]


@pytest.mark.parametrize("end", ["</tool_call>", " </tool_call>\n<tool_call>", "</tool_call> after"])
@pytest.mark.parametrize("call", ['{"name": "f", "arguments": {"a": 1', '{"name": "f", "arguments": {"a": "x',
                                  '{"name": "f", "arguments": tru', '{"name": "f", "arguments": '])
def test_a_hermes_call_left_open_before_its_end_tag_streams_what_the_whole_parse_says(call, end):
    """The object ends at the block's tag; streamed, the characters of a tag that was still being
    written were sent as arguments ("</too"), which the tag then took back. Cut at every point."""
    text = f"<tool_call>\n{call}{end}"
    plan = lambda: ToolPlan("auto", TOOL_PARSERS["hermes"]())  # noqa: E731
    whole = [c.arguments for c in chat_output.announced(ChoiceReader(plan(), None).parse(text, final=True)[2].calls)]
    message, reason = ChoiceReader(plan(), None).message(text, "stop")
    # ended by the model with no JSON object: no call, the text is the answer (vLLM's parsers)
    assert "tool_calls" not in message and message["content"] == text and reason == "stop"
    assert [c["function"]["arguments"] for c in ChoiceReader(plan(), None).message(text, "length")[0]["tool_calls"]] \
        == whole   # cut by max_tokens: the call as far as it got, as OpenAI returns it
    for cut in range(1, len(text)):
        reader = ChoiceReader(plan(), None)
        deltas = [reader.delta(text[:cut], None)[0], reader.delta(text[cut:], "stop")[0]]
        streamed: dict[int, str] = {}
        for entry in (e for d in deltas for e in d.get("tool_calls", [])):
            streamed[entry["index"]] = streamed.get(entry["index"], "") + entry["function"].get("arguments", "")
        assert [streamed[i] for i in sorted(streamed)] == whole, text[:cut]


DUPLICATE_KEYS = {"hermes": '<tool_call>\n{"name": "f", "name": "g", "arguments": {"a": 1}, "arguments": {"b": 2}}\n'
                             '</tool_call>',
                  "mistral": '[TOOL_CALLS] [{"name": "f", "name": "g", "arguments": {"a": 1}, "arguments": {"b": 2}}]',
                  "llama3_json": '{"name": "f", "name": "g", "parameters": {"a": 1}, "parameters": {"b": 2}}',
                  "pythonic": "[f(a=1, a=2)]"}


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_a_call_that_repeats_its_keys_is_read_by_the_first_streamed_or_whole(parser):
    """A stream names the call from the first "name" it sees; the whole message read the object
    with json's last-wins and named it "g". Cut at every point."""
    text = DUPLICATE_KEYS[parser]
    plan = lambda: ToolPlan("auto", TOOL_PARSERS[parser]())  # noqa: E731
    message, _ = ChoiceReader(plan(), None).message(text, "stop")
    whole = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert whole == [("f", {"a": 1})]
    for cut in range(1, len(text)):
        reader = ChoiceReader(plan(), None)
        deltas = [reader.delta(text[:cut], None)[0], reader.delta(text[cut:], "stop")[0]]
        name, args = "", ""
        for entry in (e for d in deltas for e in d.get("tool_calls", [])):
            name, args = name + entry["function"].get("name", ""), args + entry["function"]["arguments"]
        assert (name, json.loads(args)) == whole[0], text[:cut]


OPENING = str.maketrans("]}", "[{")


def long_outputs(chars: int) -> dict[str, tuple[str, str | None, bool]]:
    """name -> (text, tool parser, reasoning on): each about `chars` long, as bench/chat_stream_parse.py."""
    rng = random.Random(0)
    words = "the a model of weather in Paris is mild take coat {braces} [list] x<y".split()
    prose = " ".join(rng.choice(words) for _ in range(chars // 4))[:chars]
    long_args = json.dumps({"path": "a.py", "content": prose})
    return {"prose, hermes": (prose, "hermes", False), "prose, mistral": (prose, "mistral", False),
            "prose, llama3_json": (prose, "llama3_json", False), "think then prose": (
                f"<think>{prose[:chars // 2]}</think>{prose[chars // 2:]}", "hermes", True),
            "hermes call, long arguments": (f'<tool_call>\n{{"name": "w", "arguments": {long_args}}}\n</tool_call>',
                                            "hermes", False),
            "mistral call, long arguments": (f'[TOOL_CALLS] [{{"name": "w", "arguments": {long_args}}}]', "mistral",
                                             False),
            "llama3_json call, long arguments": (f'{{"name": "w", "parameters": {long_args}}}', "llama3_json", False),
            "many hermes calls": ("".join(call_text("hermes", [("f", {"i": i, "s": prose[i:i + 40]})])
                                          for i in range(chars // 80)), "hermes", False),
            # crafted: every block stays open and reads what follows; a number's digits keep coming
            # (prose with no closing bracket: no block closes, all of them read every update)
            "hermes blocks nested in open calls": ("".join(NESTED * 75) + prose.translate(OPENING), "hermes", False),
            "hermes call, bare-number arguments": ('<tool_call>{"name": "f", "arguments": ' + "7" * chars, "hermes",
                                                   False),
            "mistral call, bare-number arguments": ('[TOOL_CALLS] [{"name": "f", "arguments": -1.' + "7" * chars,
                                                    "mistral", False),
            "llama3_json call, bare-number arguments": ('{"name": "f", "parameters": 1' + "7" * chars, "llama3_json",
                                                        False)}


class Counted:
    """A pattern or decoder that counts the characters it reads: from where it starts to where it
    stops (a failed search reads to the end of the text)."""

    def __init__(self, real, reads: list[int]) -> None:
        self.real, self.reads = real, reads

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def search(self, text: str, pos: int = 0):
        found = self.real.search(text, pos)
        self.reads[0] += (found.end() if found else len(text)) - pos
        return found

    def match(self, text: str, pos: int = 0):
        found = self.real.match(text, pos)
        self.reads[0] += (found.end() - pos if found else 0) + 1
        return found

    def raw_decode(self, text: str, pos: int = 0):
        try:
            value, end = self.real.raw_decode(text, pos)
        except JSONDecodeError as exc:
            self.reads[0] += exc.pos - pos + 1
            raise
        self.reads[0] += end - pos
        return value, end


@pytest.mark.parametrize("name", sorted(long_outputs(1)))
def test_a_long_stream_reads_each_character_a_bounded_number_of_times(monkeypatch, name):
    """Every scan of the text goes through the readers' patterns and decoder: counted, a 40k-update
    stream reads a few times its length, and its last updates read no more than its first."""
    reads = [0]
    for module in (base, stream, hermes, mistral, llama3_json, reasoning, chat_output):
        for attr, value in list(vars(module).items()):
            if isinstance(value, (re.Pattern, json.JSONDecoder)):
                monkeypatch.setattr(module, attr, Counted(value, reads))
    looked_at = [0]   # calls whose arguments an update compares with what was sent

    def added(*args):
        looked_at[0] += 1
        return real_added(*args)
    real_added = chat_output._added
    monkeypatch.setattr(chat_output, "_added", added)
    text, parser, thinking = long_outputs(160_000)[name]
    reader = ChoiceReader(ToolPlan("auto", TOOL_PARSERS[parser]()), Qwen3ReasoningParser() if thinking else None)
    per_update = []
    for pos in range(0, len(text), 4):
        before, calls_before = reads[0], looked_at[0]
        reader.delta(text[pos:pos + 4], "stop" if pos + 4 >= len(text) else None)
        per_update.append(reads[0] - before)
        assert looked_at[0] - calls_before <= 2, pos   # not every open call at every update
    assert len(per_update) >= 40_000
    # what a closed call is decoded from is read again once, whole: a few times the text in all
    assert sum(per_update) <= 12 * len(text), sum(per_update) / len(text)
    # the thousand updates before the end (150 kB in) read what the first thousand did
    assert sum(per_update[-1100:-100]) <= 2 * sum(per_update[:1000]) + 1000, (per_update[:1000], per_update[-1100:])


@pytest.mark.parametrize("name", ["prose, hermes", "think then prose", "hermes call, long arguments"])
def test_a_long_stream_allocates_at_each_update_only_about_what_it_adds(name):
    """`self.text += piece` copied the whole text at every update, and each parse sliced it again:
    a 160 kB text allocated 160 kB per update, O(n^2) over the stream (32 s of copying at 1 MB)."""
    text, parser, thinking = long_outputs(160_000)[name]
    reader = ChoiceReader(ToolPlan("auto", TOOL_PARSERS[parser]()), Qwen3ReasoningParser() if thinking else None)
    for pos in range(0, len(text) - 40_000, 4):
        reader.delta(text[pos:pos + 4], None)
    peaks = []
    tracemalloc.start()
    try:
        for pos in range(len(text) - 40_000, len(text) - 4, 4):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            reader.delta(text[pos:pos + 4], None)
            peaks.append(tracemalloc.get_traced_memory()[1] - before)
    finally:
        tracemalloc.stop()
    assert max(sorted(peaks)[:-10]) < 8_000, sorted(peaks)[-20:]   # 120 kB and more were streamed before
