"""vLLM's prompt_logprobs through the HTTP API, with the real `openai` client: per prompt token
null (the first) or {token id: {logprob, rank, decoded_token}}, the token itself first, then its
top alternatives; in each completion choice, and beside the choices in chat."""

from __future__ import annotations

import httpx
import openai
import pytest

from nanoserve import SamplingParams
from tests.server.conftest import openai_client

PROMPTS = ["The function returns a list of", "A dict maps keys"]
CHAT = [{"role": "user", "content": "What is a dict?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server.url, timeout=120)


def scored(offline, prompt, top: int = 20):
    """The prompt's ids and, per token, its logprob and top alternatives, offline."""
    ref = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top),
                           use_tqdm=False)[0]
    return ref.prompt_token_ids, ref.outputs[0].prompt_logprobs.entries()


def check(entries: list, prompt_ids: list[int], ref: list, top_n: int, offline) -> None:
    """`entries` (the server's, for top_n) against `ref` (offline, with 20 alternatives)."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for token_id, entry, (chosen, alternatives, rank) in zip(prompt_ids[1:], entries[1:], ref[1:]):
        keys = list(entry)
        assert keys[0] == str(token_id)                     # the prompt token first, as vLLM lists it
        assert set(keys[1:]) <= {str(t) for t, _ in alternatives[:top_n]}
        assert len(set(keys) | {str(t) for t, _ in alternatives[:top_n]}) == len(keys)
        mine = entry[str(token_id)]
        assert mine["logprob"] == pytest.approx(chosen, abs=1e-4)
        assert mine["decoded_token"] == offline.tokenizer.decode([token_id])
        # the rank over the whole vocabulary, which 20 alternatives confirm where they reach the token
        assert isinstance(mine["rank"], int) and mine["rank"] == rank
        if chosen >= alternatives[-1][1]:
            assert rank == 1 + sum(lp > chosen for _, lp in alternatives)
        else:
            assert rank > len(alternatives)
        for r, (tid, lp) in enumerate(alternatives[:top_n], start=1):
            if tid != token_id:
                assert entry[str(tid)]["rank"] == r and entry[str(tid)]["logprob"] == pytest.approx(lp, abs=1e-4)


@pytest.mark.parametrize("top_n", [0, 3])
def test_completion_choices_carry_their_prompts_logprobs(client, server, offline, top_n):
    refs = [scored(offline, p) for p in PROMPTS]
    out = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=4, temperature=0, n=2,
                                    extra_body={"prompt_logprobs": top_n})
    assert len(out.choices) == 4
    for choice in out.choices:
        prompt_ids, ref = refs[choice.index // 2]
        check(choice.prompt_logprobs, prompt_ids, ref, top_n, offline)
    assert out.usage.prompt_tokens_details.cached_tokens == 0   # every prompt position is computed
    server.wait_idle()


def test_echoed_logprobs_keep_their_own_count_beside_more_prompt_logprobs(client, offline):
    prompt_ids, ref = scored(offline, PROMPTS[0])
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0, echo=True,
                                    logprobs=1, extra_body={"prompt_logprobs": 4})
    choice = out.choices[0]
    check(choice.prompt_logprobs, prompt_ids, ref, 4, offline)
    assert choice.logprobs.token_logprobs[0] is None
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs[1:])   # 1 alternative + the token
    assert choice.logprobs.token_logprobs[1:len(prompt_ids)] == pytest.approx([entry[0] for entry in ref[1:]], abs=1e-4)


def test_chat_carries_the_prompt_logprobs_beside_the_choices(client, offline):
    text = offline.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    prompt = offline.tokenizer.encode(text, add_special_tokens=False)
    prompt_ids, ref = scored(offline, prompt)
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 2})
    check(out.prompt_logprobs, prompt_ids, ref, 2, offline)
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert "prompt_logprobs" not in plain.model_extra


@pytest.mark.parametrize("path, body", [("completions", {"prompt": PROMPTS[0]}), ("chat/completions", {"messages": CHAT})])
def test_a_stream_may_ask_for_0_and_gets_none_as_in_vllm(server, path, body):
    with httpx.stream("POST", f"{server.url}/v1/{path}", timeout=60,
                      json={**body, "max_tokens": 2, "stream": True, "prompt_logprobs": 0}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and not any("prompt_logprobs" in e for e in events)


@pytest.mark.parametrize("path, body", [("completions", {"prompt": PROMPTS[0]}), ("chat/completions", {"messages": CHAT})])
@pytest.mark.parametrize("extra, words", [({"prompt_logprobs": 1, "stream": True}, "not available when stream"),
                                          ({"prompt_logprobs": -1}, "whole vocabulary"),
                                          ({"prompt_logprobs": 21}, "at most 20"),
                                          ({"prompt_logprobs": -2}, "greater than or equal to -1"),
                                          ({"prompt_logprobs": "2"}, "Invalid type")])
def test_a_bad_prompt_logprobs_is_a_400_naming_it(server, path, body, extra, words):
    r = httpx.post(f"{server.url}/v1/{path}", json={**body, "max_tokens": 2, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt_logprobs" and words in error["message"], error


def test_a_long_prompts_logprobs_are_built_off_the_event_loop_and_shared_by_its_choices(client, server, offline):
    # 600 tokens x 21 entries: past what is built inline, so a worker thread builds them
    prompt = [100 + (7 * i) % 3000 for i in range(600)]
    prompt_ids, ref = scored(offline, prompt)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, n=2,
                                    extra_body={"prompt_logprobs": 20})
    assert out.choices[0].prompt_logprobs == out.choices[1].prompt_logprobs
    check(out.choices[0].prompt_logprobs, prompt_ids, ref, 20, offline)
    server.wait_idle()
