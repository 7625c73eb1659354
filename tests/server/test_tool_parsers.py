"""Tool-call parsers on real chat-template renderings (Qwen3, Llama 3.1, Mistral v0.3; see
tests/assets/chat_templates/NOTICE.md): the calls a template writes into history are the calls
its parser reads back, whole and streamed in any split."""

from __future__ import annotations

import json
import random
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from nanoserve.config import DEFAULT_MODEL
from nanoserve.server.chat_output import ChoiceReader
from nanoserve.server.conversation import template_inputs
from nanoserve.server.chat_protocol import ChatMessage, Tool
from nanoserve.server.reasoning import REASONING_PARSERS, Qwen3ReasoningParser
from nanoserve.server.tool_parsers import TOOL_PARSERS
from nanoserve.server.tools import ToolPlan

TEMPLATES = Path(__file__).resolve().parents[1] / "assets" / "chat_templates"
TOOLS = [Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}),
    Tool.model_validate({"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {
            "type": "number"}}}}})]
CALLS = [("get_weather", {"city": "Paris, \"FR\"", "days": 3}), ("add", {"a": 1.5, "b": -2})]
# (template file, parser, how many calls the template can write in one turn, what ends the turn)
FORMATS = [("qwen3.jinja", "hermes", 2, "<|im_end|>"), ("llama3.1.jinja", "llama3_json", 1, "<|eot_id|>"),
           ("mistral-v0.3.jinja", "mistral", 2, "</s>")]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def render(tokenizer, template: str, messages: list[dict], generation_prompt: bool) -> str:
    conversation, extra = template_inputs([ChatMessage.model_validate(m) for m in messages], TOOLS, None)
    return tokenizer.apply_chat_template(conversation, chat_template=(TEMPLATES / template).read_text(),
                                         add_generation_prompt=generation_prompt, tokenize=False,
                                         bos_token="<s>", eos_token="</s>", **extra)


def history(n_calls: int) -> list[dict]:
    calls = [{"id": f"call{i}abcd", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
             for i, (n, a) in enumerate(CALLS[:n_calls])]
    return [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": calls}]


def assistant_turn(tokenizer, template: str, n_calls: int, end: str) -> str:
    """What the model writes for these calls: the template's rendering of the assistant turn."""
    messages = history(n_calls)
    before = render(tokenizer, template, messages[:1], True)
    whole = render(tokenizer, template, messages, False)
    assert whole.startswith(before)
    return whole[len(before):].rstrip().removesuffix(end)


def reasoning_for(parser: str) -> Qwen3ReasoningParser | None:
    # Qwen3's template writes the last assistant turn with its (empty) <think> block, as the model does
    return Qwen3ReasoningParser() if parser == "hermes" else None


@pytest.mark.parametrize("template, parser, n_calls, end", FORMATS, ids=[f[1] for f in FORMATS])
def test_parser_reads_back_the_calls_its_template_writes(tokenizer, template, parser, n_calls, end):
    text = assistant_turn(tokenizer, template, n_calls, end)
    if reasoning_for(parser):
        assert text.startswith("<think>\n\n</think>\n\n")
        text = reasoning_for(parser).parse(text, True)[1]
    parsed = TOOL_PARSERS[parser]().parse(text, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == CALLS[:n_calls], text
    assert all(c.complete for c in parsed.calls) and not parsed.content.strip()


@pytest.mark.parametrize("template, parser, n_calls, end", FORMATS, ids=[f[1] for f in FORMATS])
def test_streamed_calls_in_any_split_reassemble_to_the_whole_parse(tokenizer, template, parser, n_calls, end):
    text = assistant_turn(tokenizer, template, n_calls, end)
    plan = ToolPlan("auto", TOOL_PARSERS[parser]())
    whole, finish = ChoiceReader(plan, reasoning_for(parser)).message(text, "stop")
    assert finish == "tool_calls"
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    for seed in range(5):
        rng, reader, pos = random.Random(seed), ChoiceReader(plan, reasoning_for(parser)), 0
        calls: dict[int, dict] = {}
        while pos < len(text):
            step = rng.randint(1, 7)
            last = pos + step >= len(text)
            delta, finish = reader.delta(text[pos:pos + step], "stop" if last else None)
            pos += step
            entries = delta.get("tool_calls", [])
            assert len({d["index"] for d in entries}) == len(entries)  # one entry per call in a delta
            for d in entries:
                if d["index"] not in calls:  # OpenAI's order: id, type and name come first
                    assert d["id"] and d["type"] == "function" and set(d["function"]) == {"name", "arguments"}
                    calls[d["index"]] = {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}
                else:
                    assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                    calls[d["index"]]["arguments"] += d["function"]["arguments"]
            assert not delta.get("content", "").strip()
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_text_without_calls_is_content(parser):
    text = "The weather in Paris is mild; take a coat {maybe}."
    reader = ChoiceReader(ToolPlan("auto", TOOL_PARSERS[parser]()), None)
    message, finish = reader.message(text, "stop")
    assert message == {"role": "assistant", "content": text} and finish == "stop"
    streamed = ChoiceReader(ToolPlan("auto", TOOL_PARSERS[parser]()), None)
    pieces = [streamed.delta(text[i:i + 3], "stop" if i + 3 >= len(text) else None)[0] for i in range(0, len(text), 3)]
    assert "".join(p.get("content", "") for p in pieces) == text


def test_content_before_the_calls_is_kept():
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    message, _ = ChoiceReader(ToolPlan("auto", TOOL_PARSERS["hermes"]()), None).message(text, "stop")
    assert message["content"] == "Let me check.\n" and message["tool_calls"][0]["function"]["arguments"] == \
        '{"a": 1, "b": 2}'
    mistral = 'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]'
    message, _ = ChoiceReader(ToolPlan("auto", TOOL_PARSERS["mistral"]()), None).message(mistral, "stop")
    assert message["content"] == "Sure. " and message["tool_calls"][0]["function"]["name"] == "add"


def test_llama3_json_reads_the_python_tag_and_several_calls():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {"city": "X"}}'
    parsed = TOOL_PARSERS["llama3_json"]().parse(text, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("add", {"a": 1}), ("get_weather",
                                                                                             {"city": "X"})]
    assert TOOL_PARSERS["llama3_json"]().parse('{"answer": 42}', final=True).content == '{"answer": 42}'


@pytest.mark.parametrize("template, parser, n_calls, end", FORMATS, ids=[f[1] for f in FORMATS])
def test_tool_results_reach_the_template_as_it_expects(tokenizer, template, parser, n_calls, end):
    messages = history(n_calls) + [{"role": "tool", "tool_call_id": f"call{i}abcd", "content": f"result-{i}"}
                                   for i in range(n_calls)]
    text = render(tokenizer, template, messages, True)
    marker = {"hermes": "<tool_response>\nresult-0\n</tool_response>",
              # (Llama 3.1's template writes any string result with tojson: quoted, as Meta ships it)
              "llama3_json": '<|start_header_id|>ipython<|end_header_id|>\n\n"result-0"<|eot_id|>',
              "mistral": '[TOOL_RESULTS] {"content": result-0, "call_id": "call0abcd"}[/TOOL_RESULTS]'}[parser]
    assert marker in text, text
    assert '"Paris, \\"FR\\""' in text  # the arguments, written once as JSON (not a quoted JSON string)


def test_qwen3_reasoning_is_split_whole_and_streamed():
    parser = Qwen3ReasoningParser()
    text = "<think>\nweigh it up\n</think>\n\nThe answer."
    assert parser.parse(text, True) == ("\nweigh it up\n", "\n\nThe answer.")
    assert parser.parse("No thinking here.", True) == (None, "No thinking here.")
    reader = ChoiceReader(ToolPlan(), parser)
    deltas = [reader.delta(text[i:i + 2], "stop" if i + 2 >= len(text) else None)[0] for i in range(0, len(text), 2)]
    assert "".join(d.get("reasoning", "") for d in deltas) == "".join(d.get("reasoning_content", "") for d in deltas) \
        == "\nweigh it up\n"
    assert "".join(d.get("content", "") for d in deltas) == "\n\nThe answer."


def test_a_mistral_call_cut_off_inside_its_arguments_keeps_what_was_written():
    """The final parse of an unclosed call list must not eat a bracket of the arguments: it says
    what the streamed parse said."""
    text = '[TOOL_CALLS] [{"name": "f", "arguments": {"a": [1, 2]'
    parser = TOOL_PARSERS["mistral"]()
    final, streamed = parser.parse(text, final=True), parser.parse(text, final=False)
    assert final.calls[0].arguments == streamed.calls[0].arguments == '{"a": [1, 2]'


def stream(reader: ChoiceReader, text: str, finish: str, step: int = 3) -> list[dict]:
    return [reader.delta(text[i:i + step], finish if i + step >= len(text) else None)[0]
            for i in range(0, len(text), step)]


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("name", ['\\u12', 'a\tb', '\\x', 'f\\'])
def test_a_call_name_json_cannot_read_is_no_error(parser, name):
    """A broken escape or a raw control character in a call's name: the text is still read,
    whole and streamed, and nothing raises (it was a 500, or a stream cut off mid-body)."""
    opening = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS] [",
               "pythonic": "["}[parser]
    for text in (f'{opening}{{"name": "{name}", "arguments": {{', f'{opening}{{"name": "{name}", "arguments": {{}}}}'):
        message, _ = ChoiceReader(ToolPlan("auto", TOOL_PARSERS[parser]()), None).message(text, "stop")
        assert message["role"] == "assistant"
        stream(ChoiceReader(ToolPlan("auto", TOOL_PARSERS[parser]()), None), text, "stop")


@pytest.mark.parametrize("plan, text", [
    (lambda: ToolPlan("auto", TOOL_PARSERS["hermes"]()), 'Sure <tool_call>{"na'),
    (lambda: ToolPlan("required", TOOL_PARSERS["hermes"]()), '[{"name"'),
])
def test_a_call_cut_off_before_its_name_streams_the_content_the_whole_message_has(plan, text):
    whole, _ = ChoiceReader(plan(), None).message(text, "length")
    deltas = stream(ChoiceReader(plan(), None), text, "length")
    assert "".join(d.get("content", "") for d in deltas) == whole["content"] == text
    assert not any("tool_calls" in d for d in deltas) and "tool_calls" not in whole


def test_a_call_cut_off_by_max_tokens_after_its_name_is_the_same_call_whole_and_streamed():
    text = 'Sure <tool_call>{"name": "f", "arguments": {"a": 1'
    plan = lambda: ToolPlan("auto", TOOL_PARSERS["hermes"]())  # noqa: E731
    whole, finish = ChoiceReader(plan(), None).message(text, "length")
    deltas = stream(ChoiceReader(plan(), None), text, "length")
    assert finish == "length" and whole["content"] == "Sure " == "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls if "id" in c] == [whole["tool_calls"][0]["function"]["name"]] == ["f"]
    assert "".join(c["function"]["arguments"] for c in calls) == whole["tool_calls"][0]["function"]["arguments"]


def test_qwen3_reasoning_opened_by_the_template_in_the_prompt_is_still_reasoning():
    """Thinking templates that end the prompt with `<think>` leave the output to start inside it."""
    parser = Qwen3ReasoningParser()
    assert parser.opens_in("<|im_start|>assistant\n<think>\n")
    assert not parser.opens_in("<|im_start|>assistant\n<think>\n\n</think>\n\n")   # enable_thinking false
    assert not parser.opens_in("<|im_start|>assistant\n")
    text = "weigh it up\n</think>\n\nThe answer."
    assert Qwen3ReasoningParser(opened_in_prompt=True).parse(text, True) == ("weigh it up\n", "\n\nThe answer.")
    assert Qwen3ReasoningParser().parse(text, True) == (None, text)
    reader = ChoiceReader(ToolPlan(), Qwen3ReasoningParser(opened_in_prompt=True))
    deltas = [reader.delta(text[i:i + 2], "stop" if i + 2 >= len(text) else None)[0] for i in range(0, len(text), 2)]
    assert "".join(d.get("reasoning", "") for d in deltas) == "".join(d.get("reasoning_content", "") for d in deltas) \
        == "weigh it up\n"
    assert "".join(d.get("content", "") for d in deltas) == "\n\nThe answer."


@pytest.mark.parametrize("text, reasoning, content", [
    ("weigh it up\n</think>\n\nThe answer.", "weigh it up\n", "\n\nThe answer."),   # the template opened it
    ("<think>\nweigh it up</think>The answer.", "\nweigh it up", "The answer."),          # the model opened it
    ("still weighing it up", "still weighing it up", ""),                               # cut off: all reasoning
])
def test_deepseek_r1_reasoning_starts_the_output_whether_or_not_it_opens_with_think(text, reasoning, content):
    # vLLM's deepseek_r1 parser: R1 distills (Qwen2, Llama) reason first, with or without <think>
    parser = REASONING_PARSERS["deepseek_r1"]
    tail = "<｜Assistant｜><think>\n" if text.startswith("weigh") else "<｜Assistant｜>"
    opened = parser.opens_in(tail)
    assert opened and not parser.opens_in("<｜Assistant｜><think>\n\n</think>\n\n")   # thinking turned off
    assert parser(opened).parse(text, True) == (reasoning, content)
    reader = ChoiceReader(ToolPlan(), parser(opened))
    deltas = [reader.delta(text[i:i + 2], "stop" if i + 2 >= len(text) else None)[0] for i in range(0, len(text), 2)]
    assert "".join(d.get("reasoning", "") for d in deltas) == reasoning
    assert "".join(d.get("content", "") for d in deltas) == content


@pytest.mark.parametrize("text", ['{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {}} and more'])
def test_a_llama3_json_call_the_stream_announced_is_not_repeated_as_content(text):
    """Text after a call, or a call left open, at the end: the stream had announced the call by its
    name, then sent the whole text as content too; the whole message had content and no call."""
    plan = lambda: ToolPlan("auto", TOOL_PARSERS["llama3_json"]())  # noqa: E731
    whole, finish = ChoiceReader(plan(), None).message(text, "stop")
    deltas = stream(ChoiceReader(plan(), None), text, "stop")
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls if "id" in c] == \
        [c["function"]["name"] for c in whole["tool_calls"]] == ["f"]
    assert "".join(c["function"]["arguments"] for c in calls) == whole["tool_calls"][0]["function"]["arguments"]
    assert "".join(d.get("content", "") for d in deltas) == (whole["content"] or "") == ""
    assert finish == "tool_calls"


@pytest.mark.parametrize("value", ["</tool_call>", "<tool_call>"])
def test_a_hermes_tag_inside_an_argument_string_is_part_of_the_argument(value):
    """The call's JSON decides where it ends: a tag written inside a string cut the call there,
    and the whole message lost it to content."""
    arguments = json.dumps({"html": f"a {value} b"})
    text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    plan = lambda: ToolPlan("auto", TOOL_PARSERS["hermes"]())  # noqa: E731
    whole, finish = ChoiceReader(plan(), None).message(text, "stop")
    assert finish == "tool_calls" and not whole["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == [("f", arguments)]
    calls = [c for d in stream(ChoiceReader(plan(), None), text, "stop") for c in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls if "id" in c] == ["f"]
    assert "".join(c["function"]["arguments"] for c in calls) == arguments


def test_a_streamed_required_list_reads_each_closed_call_once_and_as_the_whole_text_does(monkeypatch):
    # read again from the start at every update, 300 calls took 3.6 s of the event loop for one choice
    from nanoserve.server import chat_output
    from nanoserve.server.tool_parsers import stream
    from nanoserve.server.tool_parsers.base import scan_call, scan_call_list

    rng = random.Random(0)
    pieces = ['{"name": "f", "arguments": {"a": 1}}', ", ", " ", '{"name": "g", "arguments": {"b": "x, {y}"}}', ",",
              '{"name": "h"', ', "arguments": {}}', "junk", "\n"]
    key = lambda text, calls: [(c.name, chat_output._text(text, c.arguments), c.complete) for c in calls]  # noqa: E731
    for _ in range(200):
        text = "[" + "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        calls = chat_output._RequiredStream(0)
        for end in range(1, len(text) + 1):
            streamed = calls.update(text[:end], False)[1]
            assert key(text, streamed) == key(text, scan_call_list(text[1:end])), text[:end]
    decoded = []
    real = stream.scan_call

    def counted(text, pos=0):
        call, end = real(text, pos)
        decoded.append(end)
        return call, end

    monkeypatch.setattr(stream, "scan_call", counted)
    text = "[" + ", ".join(json.dumps({"name": "f", "arguments": {"a": i}}) for i in range(120)) + "]"
    reader = ChoiceReader(ToolPlan("required"), None)
    deltas = [reader.delta(text[i:i + 3], "stop" if i + 3 >= len(text) else None)[0]
                              for i in range(0, len(text), 3)]
    assert len(deltas) > 1000 and len(decoded) == 120   # each closed call is decoded once, when it closes
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert "".join(c["function"]["arguments"] for c in calls if c["index"] == 119) == '{"a": 119}'
    whole, _ = ChoiceReader(ToolPlan("required"), None).message(text, "stop")
    assert len(whole["tool_calls"]) == 120 and scan_call(text, 1)[0].name == "f"


TRIPLE = "'" * 3
PYTHONIC = ("[get_weather(city='Paris, \\'FR\\'', days=3), add(a=1.5, b=-2),\n"
            f" note(text={TRIPLE}a ) , ] \"quoted\" line{TRIPLE}, tags=['x', \"y\"], meta={{'k': (1, None), 'on': True}}),"
            " now()]")


def test_pythonic_calls_are_read_with_their_literal_arguments_as_json():
    """vLLM's pythonic format: keyword arguments' Python literals become the arguments' JSON."""
    parsed = TOOL_PARSERS["pythonic"]().parse(PYTHONIC, final=True)
    assert parsed.content == "" and all(c.complete for c in parsed.calls)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris, 'FR'", "days": 3}), ("add", {"a": 1.5, "b": -2}),
        ("note", {"text": 'a ) , ] "quoted" line', "tags": ["x", "y"], "meta": {"k": [1, None], "on": True}}),
        ("now", {})]


@pytest.mark.parametrize("text", ["[1, 2, 3]", "[]", "[answer]", "The list: [f(a=1)]", "[f"])
def test_pythonic_replies_that_open_no_call_are_content(text):
    parser = TOOL_PARSERS["pythonic"]()
    assert parser.parse(text, final=True).content == text and not parser.parse(text, final=True).calls
    reader = ChoiceReader(ToolPlan("auto", parser), None)
    assert "".join(d.get("content", "") for d in stream(reader, text, "stop", 1)) == text


@pytest.mark.parametrize("text, arguments", [
    ("[f(a=g(1))]", "{"),                 # no literal: the list ends; the call stays as far as it was read
    ("[f(a=1, b=x)]", '{"a": 1'),
    ("[f(a={1, 2})]", "{"),               # a set: no JSON holds it
    ("[f(a=float('nan'))]", "{"),
    ("[f(a=1), 3]", '{"a": 1}'),          # a call, then no call: the calls read so far stand
])
def test_a_pythonic_value_that_is_no_literal_ends_the_list_there(text, arguments):
    parsed = TOOL_PARSERS["pythonic"]().parse(text, final=True)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("f", arguments)] and parsed.content == ""


def test_a_pythonic_string_that_escapes_a_surrogate_reads_back_as_written_whole_and_streamed():
    # Python's "\ud83d\ude00" is two surrogates, and "\ud800" one: UTF-8 cannot encode either, so the
    # response's serializer raised (a 500 whole, a stream ended by an internal error)
    text = '[f(a="\\ud800", b={"k\\udc00": "\\ud83d\\ude00 \\u2603"})]'
    plan = ToolPlan("auto", TOOL_PARSERS["pythonic"]())
    whole, finish = ChoiceReader(plan, None).message(text, "stop")
    deltas = stream(ChoiceReader(plan, None), text, "stop")
    orjson.dumps(whole), orjson.dumps(deltas)
    arguments = whole["tool_calls"][0]["function"]["arguments"]
    assert finish == "tool_calls" and json.loads(arguments) == {"a": "\ud800", "b": {"k\udc00": "\U0001f600 \u2603"}}
    assert "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", [])) == arguments


def test_pythonic_calls_streamed_in_any_split_reassemble_to_the_whole_parse():
    plan = ToolPlan("auto", TOOL_PARSERS["pythonic"]())
    whole, finish = ChoiceReader(plan, None).message(PYTHONIC, "stop")
    assert finish == "tool_calls" and whole["content"] is None and len(whole["tool_calls"]) == 4
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    for seed in range(5):
        rng, reader, pos, calls = random.Random(seed), ChoiceReader(plan, None), 0, {}
        while pos < len(PYTHONIC):
            step = rng.randint(1, 7)
            delta, finish = reader.delta(PYTHONIC[pos:pos + step], "stop" if pos + step >= len(PYTHONIC) else None)
            pos += step
            assert not delta.get("content")
            for d in delta.get("tool_calls", []):
                entry = calls.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": ""})
                entry["arguments"] += d["function"]["arguments"]
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected


LITERALS = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                        | st.text(max_size=12),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                        max_leaves=8)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(calls=st.lists(st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True), LITERALS, max_size=3),
                      min_size=1, max_size=3), step=st.integers(1, 9))
def test_pythonic_calls_of_any_literals_read_back_whole_and_streamed(calls, step):
    """Python's own repr of each value, read back: the arguments are those values as JSON."""
    text = "[" + ", ".join(f"f{i}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")"
                           for i, a in enumerate(calls)) + "]"
    parsed = TOOL_PARSERS["pythonic"]().parse(text, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == \
        [(f"f{i}", json.loads(json.dumps(a))) for i, a in enumerate(calls)]
    reader, sent = ChoiceReader(ToolPlan("auto", TOOL_PARSERS["pythonic"]()), None), {}
    for d in stream(reader, text, "stop", step):
        for entry in d.get("tool_calls", []):
            sent[entry["index"]] = sent.get(entry["index"], "") + entry["function"]["arguments"]
    assert [sent[i] for i in sorted(sent)] == [c.arguments for c in parsed.calls]
