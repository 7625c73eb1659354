"""Whole (unstreamed) responses too large to hold at once: past a megabyte of choices the body is
sent as its choices are written, never joined in memory (256 choices echoing a 2k-token prompt's
logprobs made 1 GB, 2.4 GB of memory, and a 3 s join during which /health waited)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from tests.server.conftest import openai_client

PROMPT = [100 + (7 * i) % 3000 for i in range(400)]
# ~0.8 MB a choice: the echoed prompt's 20 alternatives and its prompt_logprobs
BIG = {"model": "tiny", "prompt": PROMPT, "n": 8, "max_tokens": 1, "echo": True, "logprobs": 20,
       "prompt_logprobs": 20, "temperature": 0}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server.url, timeout=120)


def test_a_large_completion_is_sent_as_its_choices_are_written(server):
    r = httpx.post(f"{server.url}/v1/completions", json=BIG, timeout=120)
    assert r.status_code == 200, r.text[:300]
    assert len(r.content) > 2**20 and "content-length" not in r.headers, r.headers
    body = r.json()
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]
    assert [c["index"] for c in body["choices"]] == list(range(8))
    first = body["choices"][0]
    assert len(first["logprobs"]["tokens"]) == len(PROMPT) + 1 and len(first["prompt_logprobs"]) == len(PROMPT)
    assert all(c["prompt_logprobs"] == first["prompt_logprobs"] for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == len(PROMPT)
    server.wait_idle()


def test_the_openai_client_reads_a_large_response_whole(client, server):
    out = client.completions.create(**{k: v for k, v in BIG.items() if k != "prompt_logprobs"},
                                    extra_body={"prompt_logprobs": 20})
    assert len(out.choices) == 8 and out.usage.completion_tokens == 8
    assert out.choices[7].logprobs.tokens == out.choices[0].logprobs.tokens
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A list is"}], n=64,
                                          max_tokens=40, logprobs=True, top_logprobs=20,
                                          extra_body={"ignore_eos": True, "prompt_logprobs": 2,
                                                      "return_token_ids": True})
    assert len(chat.choices) == 64 and all(len(c.logprobs.content) == 40 for c in chat.choices)
    assert chat.usage.completion_tokens == 64 * 40
    assert len(chat.prompt_logprobs) == len(chat.prompt_token_ids)   # the fields after the choices
    server.wait_idle()


def test_a_small_response_keeps_its_content_length(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "A list is", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content)
    assert json.loads(r.content)["usage"]["completion_tokens"] == 2


def test_a_client_that_leaves_during_a_large_response_costs_nothing_after(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", json=BIG, timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_raw(65536))   # then gone, with most of the body unsent
    server.wait_idle()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "A list is", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_streamed_echo_of_token_ids_is_decoded_off_the_event_loop(server_model, monkeypatch):
    # a stream's first chunk holds every choice's echo: 256 prompts of 2,000 ids, decoded for it on
    # the event loop, held /health and every other stream for 133 ms (a body may hold 1M ids)
    import threading

    from tests.server.conftest import serving, tiny_engine

    engine = tiny_engine(server_model)
    decode, decoded_on = engine.tokenizer.decode, []
    monkeypatch.setattr(engine.tokenizer, "decode", lambda ids, *args, **kwargs: decoded_on.append(
        (len(ids), threading.current_thread())) or decode(ids, *args, **kwargs))
    prompts = [[100 + (7 * i + p) % 3000 for i in range(1500)] for p in range(4)]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 1, "echo": True, "stream": True}
    with serving(engine) as (url, loop_thread):
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    first = json.loads(events[0])
    assert [c["text"] for c in first["choices"]] == [decode(p) for p in prompts]
    echoed_on = [thread for length, thread in decoded_on if length == len(prompts[0])]
    assert len(echoed_on) == len(prompts) and loop_thread not in echoed_on
