"""/v1/responses: the logprobs of a message's text, whole and streamed, as chat gives them, with the
reasoning and a call's tags left out (the Responses API's other behaviour: test_responses.py)."""

from __future__ import annotations

import re

import openai
import pytest

from tests.server.conftest import openai_client
from tests.server.test_responses import THINKING, WEATHER, streamed
# tool_server (conftest): the tool-calling tests' server, started again for this file (module scope)


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai_client(tool_server.url, timeout=300)


def test_logprobs_come_with_the_text_when_included(client):
    whole = client.responses.create(model="tiny", input="Hello", max_output_tokens=5, temperature=0,
                                    include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = whole.output[0].content[0].logprobs
    assert len(logprobs) == whole.usage.output_tokens == 5
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
               for entry in logprobs)


@pytest.mark.parametrize("stream", [False, True])
def test_a_messages_logprobs_leave_out_the_reasoning_and_its_closing_tag(client, stream):
    # the tag's tokens, held back by the reasoning parser, came with the answer's first text
    kwargs = dict(input="Think.", max_output_tokens=60, temperature=0, extra_body=THINKING,
                  include=["message.output_text.logprobs"])
    if stream:
        events = streamed(client, **kwargs)
        message = events[-1].response.output[-1]
        delta_tokens = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    else:
        message = client.responses.create(model="tiny", **kwargs).output[-1]
        delta_tokens = [lp.token for lp in message.content[0].logprobs]
    tokens = [lp.token for lp in message.content[0].logprobs]
    assert message.type == "message" and tokens == delta_tokens
    assert "".join(tokens).startswith(message.content[0].text) and "think>" not in "".join(tokens), tokens


@pytest.mark.parametrize("extra", [{"extra_body": {"structured_outputs": {"regex": "Answer here"}}},
                                   {"extra_body": {"structured_outputs": {"regex": "Answer here"}, "stop": ["here"]}},
                                   {"extra_body": {"structured_outputs": {"regex": "Answer here"}, "stop": ["An"]}},
                                   {"max_output_tokens": 4}],
                         ids=["end of sequence", "stop string", "stop string first", "max_output_tokens"])
def test_logprobs_are_the_same_whole_and_streamed_and_as_chat_gives_them(client, extra):
    # whole, the message carried the end-of-sequence token's (as chat does, whole and streamed); the
    # stream sent none for it, nor for the token that completed a stop string
    body = {"input": "Hi", "max_output_tokens": 40, "temperature": 0, "top_logprobs": 1,
            "include": ["message.output_text.logprobs"], **extra}
    whole = client.responses.create(model="tiny", **body).output[0].content[0]
    events = streamed(client, **body)
    sent = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    final = events[-1].response.output[0].content[0]
    chat_body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": body["max_output_tokens"],
                 "temperature": 0, "logprobs": True, "top_logprobs": 1, "extra_body": extra.get("extra_body")}
    chat = client.chat.completions.create(model="tiny", **chat_body).choices[0].logprobs.content
    chat_sent = [entry for chunk in client.chat.completions.create(model="tiny", stream=True, **chat_body)
                 for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content]
    assert whole.text == final.text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    for entries in (whole.logprobs, final.logprobs, chat, chat_sent):   # runs of the model: equal up to rounding
        assert [e.token for e in entries] == [e.token for e in sent]
        assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in sent], abs=1e-4)


CALL_AFTER_TEXT = re.escape('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                            '"unit": "celsius"}}\n</tool_call>')


CALL_AFTER_TEXT_BODY = {"tools": [WEATHER], "extra_body": {"structured_outputs": {"regex": CALL_AFTER_TEXT}}}


def without_tag_tokens(entries: list) -> list:
    """The entries less a leading run of a `</think>`'s tokens and a trailing run of a `<tool_call>`'s.
    A parser holds a tag's first characters back; whether their tokens reach the message then
    depends on how the engine's updates were grouped, which the front end merges when it lags, so
    two runs of one request may differ there (and only there)."""
    tokens = [e.token for e in entries]
    first = max((i for i in range(len(tokens) + 1) if "".join(tokens[:i]) in "</think>"), default=0)
    last = min((j for j in range(first, len(tokens) + 1) if "".join(tokens[j:]) in "<tool_call>"),
               default=len(tokens))
    return entries[first:last]


@pytest.mark.parametrize("extra", [{"extra_body": THINKING}, {"extra_body": {**THINKING, "stop": ["here"]}},
                                   CALL_AFTER_TEXT_BODY],
                         ids=["reasoning then answer", "stop string", "text then a call"])
def test_a_whole_message_has_the_logprobs_its_stream_sends(client, extra):
    # whole, the message carried every generated token's: the reasoning's and the call's too
    body = {"input": "Think.", "max_output_tokens": 60, "temperature": 0,
            "include": ["message.output_text.logprobs"], **extra}
    whole = client.responses.create(model="tiny", **body)
    events = streamed(client, **body)
    sent = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    assert [item.type for item in whole.output] == [item.type for item in events[-1].response.output]
    message = [item for item in whole.output if item.type == "message"][0].content[0]
    assert message.text and sent
    final = [item for item in events[-1].response.output if item.type == "message"][0].content[0]
    assert [e.token for e in final.logprobs] == [e.token for e in sent]   # one run: its stream and its end agree
    assert [e.logprob for e in final.logprobs] == [e.logprob for e in sent]
    ours, theirs = without_tag_tokens(message.logprobs), without_tag_tokens(sent)   # two runs: up to their tags
    assert ours and len(message.logprobs) - len(ours) <= len("</think>") + len("<tool_call>")
    assert [e.token for e in ours] == [e.token for e in theirs]
    assert [e.logprob for e in ours] == pytest.approx([e.logprob for e in theirs], abs=1e-4)
