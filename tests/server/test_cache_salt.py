"""vLLM's cache_salt through the HTTP API, with the real `openai` client: the prefix cache shares
blocks only between requests of the same salt, seen in `usage.prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import random

import httpx
import openai
import pytest
from tests.server.conftest import openai_client


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server.url, timeout=120)


def fresh_prompt(offline) -> list[int]:
    """50 token ids no other test sends (three full 16-token blocks before the last token)."""
    rng = random.Random()
    return [rng.randrange(100, offline.tokenizer.vocab_size - 100) for _ in range(50)]


def cached(client: openai.OpenAI, prompt: list[int], salt: str | None, **kw) -> int:
    extra = {"cache_salt": salt} if salt is not None else {}
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body=extra, **kw)
    return out.usage.prompt_tokens_details.cached_tokens


def test_requests_of_different_salts_share_no_prefix_blocks_and_of_one_salt_do(client, server, offline):
    prompt = fresh_prompt(offline)
    assert cached(client, prompt, "tenant-a") == 0
    assert cached(client, prompt, "tenant-b") == 0     # same tokens, another salt: no hit
    assert cached(client, prompt, None) == 0           # unsalted requests do not see salted blocks
    assert cached(client, prompt, "tenant-a") == 48    # the same salt hits, as without one
    assert cached(client, prompt, None) == 48
    # n > 1: the siblings fork from the first choice's salted blocks
    assert cached(client, prompt, "tenant-c", n=3) == 0
    assert cached(client, prompt, "tenant-c", n=3) == 48
    server.wait_idle()


def test_chat_requests_are_salted_too(client, server):
    messages = [{"role": "user", "content": f"Tell me about dicts, lists and sets {random.random()}" * 3}]

    def chat(salt: str) -> int:
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"cache_salt": salt})
        return [c for c in out][-1].usage.prompt_tokens_details.cached_tokens

    assert chat("one") == 0
    assert chat("two") == 0
    assert chat("one") > 0
    server.wait_idle()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("salt, words", [("", "at least 1 character"), ("s" * 1025, "at most 1024 characters"),
                                         (12345, "Invalid type"), (["a"], "Invalid type")])
def test_a_bad_cache_salt_is_a_400_naming_it(server, path, salt, words):
    body = {"prompt": "A list"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 2, "cache_salt": salt}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "cache_salt" and words in error["message"], error
