"""POST /invocations (SageMaker's route, as vLLM serves it): a chat body is served as on
/v1/chat/completions, a completion body as on /v1/completions, refusals included."""

from __future__ import annotations

import json

import httpx

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12,
        "temperature": 0}
COMPLETION = {"model": "tiny", "prompt": "The weather today is", "max_tokens": 12, "temperature": 0}


def _post(server, path: str, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=60, **kwargs,
                      **({"content": body} if isinstance(body, (str, bytes)) else {"json": body}))


def test_a_chat_body_is_a_chat_completion_and_a_prompt_body_a_completion(server):
    for body, route, kind in ((CHAT, "/v1/chat/completions", "chat.completion"),
                              (COMPLETION, "/v1/completions", "text_completion")):
        via, direct = _post(server, "/invocations", body), _post(server, route, body)
        assert via.status_code == direct.status_code == 200, via.text
        assert via.json()["object"] == kind
        assert via.json()["choices"] == direct.json()["choices"]
        assert via.json()["usage"] == direct.json()["usage"]


def test_a_streamed_chat_body_streams(server):
    with httpx.stream("POST", f"{server.url}/invocations", json={**CHAT, "stream": True}, timeout=60) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == _post(server, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]["content"]


def test_refusals_are_those_of_the_route_the_body_chose(server):
    for body, route in (({**CHAT, "temperature": -1}, "/v1/chat/completions"),
                        ({**COMPLETION, "max_tokens": -5}, "/v1/completions"),
                        ({**CHAT, "messages": "not a list"}, "/v1/chat/completions"),
                        ("{not json", "/v1/completions"),
                        ("[1, 2]", "/v1/completions"),
                        # nested past msgspec's depth, which raises RecursionError, not a DecodeError
                        ('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", "/v1/completions"),
                        # invalid UTF-8 in a key the route choice skips: it said the body had neither key
                        (b'{"pro\xffmpt": "x"}', "/v1/completions")):
        headers = {"content-type": "application/json"}
        via, direct = _post(server, "/invocations", body, headers=headers), _post(server, route, body, headers=headers)
        assert via.status_code == direct.status_code == 400, (body, via.text)
        assert via.json() == direct.json()
    neither = _post(server, "/invocations", {"model": "tiny", "input": "hello"})
    assert neither.status_code == 400
    error = neither.json()["error"]
    assert error["code"] == "invalid_request" and "'messages'" in error["message"] and "'prompt'" in error["message"]
    assert server.wait_idle()["nanoserve:kv_cache_blocks_in_use"] == 0
