"""CPU cost of reading one long streamed chat choice for reasoning and tool calls.

    python bench/chat_stream_parse.py [--pieces 40000]

Feeds `ChoiceReader.delta` (what the chat and responses streams call per update) a long output in
pieces of ~4 characters and prints, per workload, the total seconds and the seconds of the first
and of the last 1,000 updates. The reader runs on the server's event loop: if an update costs in
proportion to the text already streamed, the last 1,000 cost far more than the first and one long
stream slows every other stream of the server.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from nanoserve.server.chat_output import ChoiceReader
from nanoserve.server.reasoning import Qwen3ReasoningParser
from nanoserve.server.tool_parsers import TOOL_PARSERS
from nanoserve.server.tools import ToolPlan

WORDS = "the a model of weather in Paris is mild take coat when it rains and {braces} [list] x<y".split()


def prose(rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        word = rng.choice(WORDS)
        out.append(word)
        n += len(word) + 1
    return " ".join(out)


def workloads(chars: int) -> dict[str, tuple[str, str | None, bool]]:
    """name -> (text, tool parser or None, reasoning on)."""
    rng = random.Random(0)
    text = prose(rng, chars)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    long_args = json.dumps({"path": "a.py", "content": text})
    return {
        "prose, no tools": (text, None, False),
        "prose, hermes auto": (text, "hermes", False),
        "prose, llama3_json auto": (text, "llama3_json", False),
        "prose, mistral auto": (text, "mistral", False),
        "prose + hermes call, hermes auto": (text + call, "hermes", False),
        "prose + mistral call, mistral auto": (text + ' [TOOL_CALLS] [{"name": "f", "arguments": {}}]',
                                               "mistral", False),
        "think + prose, reasoning": ("<think>" + text[:chars // 2] + "</think>" + text[chars // 2:], None, True),
        "think + prose, reasoning + hermes auto": ("<think>" + text[:chars // 2] + "</think>" + text[chars // 2:],
                                                   "hermes", True),
        "hermes call with long arguments": (f'<tool_call>\n{{"name": "write", "arguments": {long_args}}}\n</tool_call>',
                                            "hermes", False),
        "mistral call with long arguments": (f'[TOOL_CALLS] [{{"name": "write", "arguments": {long_args}}}]',
                                             "mistral", False),
        "llama3_json call with long arguments": (f'{{"name": "write", "parameters": {long_args}}}',
                                                 "llama3_json", False),
        # crafted (guided_regex can force any text while tool_choice is auto): blocks nested inside
        # open calls' strings or objects, each left open, then prose that every one of them reads
        **{f"{n} hermes blocks nested in open calls": (nested_blocks(n, text), "hermes", False) for n in (100, 1000)},
        "1000 named hermes blocks nested in open calls": (
            '<tool_call>{"name": "f", "arguments": "</tool_call>' * 1000 + text.translate(OPENING), "hermes", False),
        "hermes call, bare-number arguments": ('<tool_call>{"name": "f", "arguments": ' + "7" * chars, "hermes", False),
        "mistral call, bare-number arguments": ('[TOOL_CALLS] [{"name": "f", "arguments": 1.' + "7" * chars,
                                                "mistral", False),
    }


OPENING = str.maketrans("]}", "[{")


def nested_blocks(n: int, text: str) -> str:
    """`n` hermes blocks, each opened inside the call before it (in a string, or in an object),
    then `text` (with no closing bracket: no block ever closes, all are read on at every update)."""
    forms = ['<tool_call>{"a": "</tool_call>', '<tool_call>{"a": [</tool_call>', '<tool_call>{"a": "\\"</tool_call>']
    return "".join(forms[i % len(forms)] for i in range(n)) + text.translate(OPENING)


def run(text: str, parser: str | None, reasoning: bool, piece: int) -> tuple[float, float, float]:
    plan = ToolPlan("auto", TOOL_PARSERS[parser]()) if parser else ToolPlan()
    reader = ChoiceReader(plan, Qwen3ReasoningParser() if reasoning else None)
    starts = list(range(0, len(text), piece))
    times = []
    for i in starts:
        t = time.perf_counter()
        reader.delta(text[i:i + piece], "stop" if i + piece >= len(text) else None)
        times.append(time.perf_counter() - t)
    return sum(times), sum(times[:1000]), sum(times[-1000:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pieces", type=int, default=40_000, help="updates per stream")
    ap.add_argument("--piece-chars", type=int, default=4)
    ap.add_argument("--only", default=None, help="run the workloads whose name contains this")
    args = ap.parse_args()
    for name, (text, parser, reasoning) in workloads(args.pieces * args.piece_chars).items():
        if args.only and args.only not in name:
            continue
        total, first, last = run(text, parser, reasoning, args.piece_chars)
        print(f"{name:40s} {len(text) / 1e3:6.0f} kB  total {total:7.3f} s  "
              f"first 1k {first * 1e3:8.2f} ms  last 1k {last * 1e3:8.2f} ms", flush=True)


if __name__ == "__main__":
    main()
