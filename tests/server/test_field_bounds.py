"""Fields whose value the request as a whole cannot honour are 400s naming them, with the real
`openai` client, before any work is queued."""

from __future__ import annotations

import openai
import pytest
from tests.server.conftest import openai_client

MESSAGES = [{"role": "user", "content": "What is a dict?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server.url, timeout=120)


def test_min_tokens_past_what_the_context_leaves_is_a_400_without_max_tokens(client, server):
    # without max_tokens chat runs to the end of the context (2,048 tokens), which min_tokens 5,000
    # cannot wait for: it once ran all 2,037 tokens (17 s on the CPU) and answered 200 "length"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"min_tokens": 5000})
    error = caught.value.body
    assert error["param"] == "min_tokens" and "5000" in error["message"], error
    server.wait_idle()
    # as much as the context leaves is still served
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                         extra_body={"min_tokens": 3})
    assert out.usage.completion_tokens == 3
