"""vLLM's request_id (and its X-Request-Id header) through the HTTP API, with the real `openai`
client: the response's id is the client's, and requests that share an id stay apart in the engine."""

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


def test_the_response_id_is_the_clients_request_id_whole_and_streamed(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, extra_body={"request_id": "job-7/a"})
    assert out.id == "cmpl-job-7/a"
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"request_id": "job-7/b"}))
    assert len(chunks) > 2 and {c.id for c in chunks} == {"cmpl-job-7/b"}
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                          extra_body={"request_id": "conversation 42"})
    assert chat.id == "chatcmpl-conversation 42"
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, stream=True,
                                                 extra_body={"request_id": "c43"}))
    assert {c.id for c in chunks} == {"chatcmpl-c43"}


def test_the_x_request_id_header_wins_over_the_field_as_in_vllm(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_headers={"X-Request-Id": "hdr"},
                                    extra_body={"request_id": "field"})
    assert out.id == "cmpl-hdr"


def test_without_a_request_id_or_with_an_empty_one_the_id_is_random(client):
    ids = {client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body=extra).id
           for extra in ({}, {"request_id": ""}, {"request_id": None})}
    assert len(ids) == 3 and all(i.startswith("cmpl-") and len(i) == 5 + 32 for i in ids)


def test_requests_in_flight_under_one_id_stay_apart(client, server, offline):
    """Both run; ending one early (its client leaves) does not touch the other, and no block leaks."""
    ref = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)[0]
    body = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                extra_body={"request_id": "same", "ignore_eos": True})
    first = client.completions.create(**body)
    assert next(iter(first)).id == "cmpl-same"
    second = client.completions.create(**{**body, "n": 2})
    head = next(iter(second))
    first.response.close()   # the first client leaves: its request is aborted in the engine
    chunks = [head, *second]
    assert {c.id for c in chunks} == {"cmpl-same"}
    for index in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index) == ref.text
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                      extra_body={"request_id": "same", "ignore_eos": True})
    assert whole.id == "cmpl-same" and whole.choices[0].text == ref.text
    server.wait_idle()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("where, value, words", [
    ("field", "x" * 257, "at most 256"), ("field", "a\nforged log line", "printable"),
    ("field", "tab\there", "printable"), ("field", 7, "Invalid type"),
    ("header", "h" * 257, "X-Request-Id header has 257 characters")])
def test_a_bad_request_id_is_a_400_naming_it(server, path, where, value, words):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    body["max_tokens"] = 2
    headers = {}
    if where == "field":
        body["request_id"] = value
    else:
        headers["X-Request-Id"] = value
    r = httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "request_id" and words in error["message"], error
