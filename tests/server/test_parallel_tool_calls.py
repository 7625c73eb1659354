"""parallel_tool_calls false against a real server (conftest's tool_server, hermes tool calls): a
reply carries one call, whatever the model writes, as OpenAI's API and vLLM answer."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import openai_client
from tests.server.test_tool_calling import MESSAGES, TOOLS, call_of

# the model, guided, writes two calls where tool_choice auto lets it decide
TWO_CALLS = (r'<tool_call>\n\{"name": "GetWeather", "arguments": \{"city": "Paris", "unit": "celsius"\}\}\n'
             r'</tool_call>\n<tool_call>\n\{"name": "Add", "arguments": \{"a": 1, "b": 2\}\}\n</tool_call>')
PARIS = ("GetWeather", '{"city": "Paris", "unit": "celsius"}')


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai_client(tool_server.url, timeout=300)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_with_parallel_tool_calls_false_a_reply_carries_its_first_call_only(client, stream):
    # the flag was read for tool_choice required alone (its grammar); under auto both calls came back
    assert call_of(client, TWO_CALLS, stream, parallel_tool_calls=False) == (None, [PARIS], "tool_calls")
    assert call_of(client, TWO_CALLS, stream, parallel_tool_calls=True) == \
        (None, [PARIS, ("Add", '{"a": 1, "b": 2}')], "tool_calls")


def test_a_response_with_parallel_tool_calls_false_has_one_function_call(client):
    response = client.responses.create(model="tiny", input=MESSAGES[0]["content"], tools=[
        {"type": "function", **t["function"]} for t in TOOLS], parallel_tool_calls=False, temperature=0,
        max_output_tokens=300, extra_body={"structured_outputs": {"regex": TWO_CALLS}})
    calls = [(item.name, item.arguments) for item in response.output if item.type == "function_call"]
    assert calls == [PARIS] and response.parallel_tool_calls is False
