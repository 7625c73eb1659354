"""vLLM's allowed_token_ids, spaces_between_special_tokens and bad_words through the HTTP API,
with the real `openai` client (extra_body), as vLLM serves them."""

from __future__ import annotations

import httpx
import openai
import pytest

from nanoserve import SamplingParams
from tests.server.conftest import openai_client

PROMPT = "A list is"
MESSAGES = [{"role": "user", "content": "What is a dict?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server.url, timeout=120)


def allowed_ids(offline) -> list[int]:
    """Ten ids that greedy decoding of PROMPT would not pick by itself."""
    free = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].token_ids
    return [t for t in range(100, 400, 30) if t not in free][:10]


def test_allowed_token_ids_limit_completions_and_chat_streamed_or_not(client, offline):
    allowed = allowed_ids(offline)
    ref = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                  allowed_token_ids=allowed), use_tqdm=False)[0]
    body = {"allowed_token_ids": allowed, "ignore_eos": True}
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                    extra_body=body)
    assert out.choices[0].text == ref.text and set(ref.token_ids) <= set(allowed)
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                         extra_body=body)
    assert "".join(c.choices[0].text for c in streamed) == ref.text
    sampled = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=4,
                                        extra_body={**body, "return_tokens_as_token_ids": True, "top_k": 5},
                                        logprobs=0)
    for choice in sampled.choices:
        ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
        assert len(ids) == 8 and set(ids) <= set(allowed)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                          logprobs=True, extra_body={**body, "return_tokens_as_token_ids": True})
    ids = [int(t.token.removeprefix("token_id:")) for t in chat.choices[0].logprobs.content]
    assert len(ids) == 6 and set(ids) <= set(allowed)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("ids, words", [([], "at least one"), ([5, 1 << 20], "out of range"), ([-1], "allowed_token_ids"),
                                        (list(range(4096)) * 2, "vocabulary"), (["7"], "allowed_token_ids"),
                                        ([1] * ((1 << 18) + 1), "allowed_token_ids")])
def test_a_bad_allowed_token_ids_list_is_a_400_naming_it(server, path, ids, words):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 2, "allowed_token_ids": ids}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("allowed_token_ids") and words in error["message"], error


def test_spaces_between_special_tokens_is_served_on_both_endpoints(client, offline):
    # special tokens only (<|im_start|>, <|im_end|>), shown: the byte-level tokenizer writes them
    # side by side whatever the flag, as vLLM's detokenizer does for it
    body = {"allowed_token_ids": [1, 2], "ignore_eos": True, "skip_special_tokens": False}
    for spaces in (True, False):
        ref = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                      allowed_token_ids=[1, 2], skip_special_tokens=False,
                                                      spaces_between_special_tokens=spaces), use_tqdm=False)[0]
        assert ref.text == offline.tokenizer.decode(ref.token_ids) and ref.text.count("<|im_") == 4
        extra = {**body, "spaces_between_special_tokens": spaces}
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, extra_body=extra)
        assert out.choices[0].text == ref.text
        chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                              stream=True, extra_body=extra)
        text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        assert text.count("<|im_") == 4 and " " not in text


def test_bad_words_are_never_completed_on_both_endpoints(client, offline):
    from nanoserve.engine.bad_words import bad_words_token_ids

    tok = offline.tokenizer
    free = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)[0]
    bad = [w for w in free.text.split() if len(tok.encode(w, add_special_tokens=False)) > 1][:3]
    ref = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, bad_words=bad),
                           use_tqdm=False)[0]
    assert ref.text != free.text
    extra = {"bad_words": bad, "ignore_eos": True, "return_tokens_as_token_ids": True}
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, extra_body=extra)
    assert out.choices[0].text == ref.text
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0.9, n=2,
                                          seed=1, logprobs=True, extra_body=extra)
    for choice in chat.choices:
        ids = [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]
        assert not any(ids[i:i + len(s)] == s for s in bad_words_token_ids(tok, bad) for i in range(len(ids)))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("words", [["x"] * 129, ["x" * 257], [" "], "x"])
def test_too_many_long_or_blank_bad_words_are_a_400_naming_them(server, path, words):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 2, "bad_words": words}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("bad_words"), r.text
