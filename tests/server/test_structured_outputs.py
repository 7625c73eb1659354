"""Structured outputs through the openai client: parse() with twenty pydantic models, json_object,
regex, choice and EBNF, on both endpoints, streamed and not, n=3, and under KV-cache preemption.

The bundled model was never trained on JSON: every valid object below is the grammar's doing."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from nanoserve import SamplingParams
from tests.server.conftest import ServerProcess, openai_client
from tests.server.structured_models import MODELS

MAX_TOKENS = 400  # the longest of these objects takes some 300 tokens of this model's whitespace and words
REGEX = r"[a-z]{2,6}-[0-9]{3}"
CHOICES = ["alpha", "beta gamma", "delta"]


def ask(model: type) -> list[dict]:
    return [{"role": "user", "content": f"Describe a {model.__name__} as JSON."}]


def concurrently(fn, items: list) -> list:
    # all at once, so the engine batches them: constrained rows side by side in every step
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server.url, timeout=300)


@pytest.fixture(scope="module")
def tight_server(server_model, tmp_path_factory):
    """A KV cache of 40 blocks of 16 tokens: three long choices of a few requests cannot all fit."""
    with ServerProcess(server_model, tmp_path_factory.mktemp("tight-kv"), "--max-model-len", "512",
                       "--num-kvcache-blocks", "40", "--block-size", "16", "--max-num-seqs", "16") as proc:
        yield proc


def check_parsed(model: type, completion) -> None:
    for choice in completion.choices:
        assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, model)
        assert model.model_validate_json(choice.message.content) == choice.message.parsed


def test_parse_gives_a_validated_object_for_twenty_models(client):
    assert len(set(MODELS)) == 20

    def parse(model):
        return model, client.chat.completions.parse(model="tiny", messages=ask(model), response_format=model,
                                                    max_tokens=MAX_TOKENS, temperature=0)
    for model, completion in concurrently(parse, MODELS):
        check_parsed(model, completion)


def test_parse_streamed_with_three_sampled_choices(client):
    def stream(model):
        with client.chat.completions.stream(model="tiny", messages=ask(model), response_format=model,
                                            max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=3) as events:
            return model, events.get_final_completion()
    for model, completion in concurrently(stream, MODELS):
        assert len(completion.choices) == 3
        check_parsed(model, completion)


def test_parse_with_three_sampled_choices_not_streamed(client):
    def parse(model):
        return model, client.chat.completions.parse(model="tiny", messages=ask(model), response_format=model,
                                                    max_tokens=MAX_TOKENS, temperature=0.8, seed=11, n=3)
    for model, completion in concurrently(parse, MODELS[::2]):
        check_parsed(model, completion)
        assert len({c.message.content for c in completion.choices}) > 1  # each choice walked its own grammar


def texts_of(client: openai.OpenAI, endpoint: str, stream: bool, n: int = 3, prompt: str = "The answer is",
             temperature: float = 1.0, **fields) -> list[str]:
    """Every choice's text, from /v1/chat/completions or /v1/completions, streamed or whole; all must stop."""
    common = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=temperature, seed=5, n=n, stream=stream)
    if endpoint == "chat":
        out = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common, **fields)
    else:
        out = client.completions.create(prompt=prompt, **common, **fields)
    texts = [""] * n
    finish = [None] * n
    for chunk in (out if stream else [out]):
        for c in chunk.choices:
            piece = (c.delta.content if stream else c.message.content) if endpoint == "chat" else c.text
            texts[c.index] += piece or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert finish == ["stop"] * n, texts
    return texts


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_object_output_always_parses(client, endpoint, stream):
    # greedy, on prompts where this model closes its keys: sampled, it writes prose into a key for
    # longer than any max_tokens a test can afford (the output would be cut, not invalid)
    prompt = "The answer is" if endpoint == "chat" else "Give me JSON"
    for text in texts_of(client, endpoint, stream, prompt=prompt, temperature=0.0,
                         extra_body={"response_format": {"type": "json_object"}}):
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_regex_and_choice_always_match(client, endpoint, stream):
    for text in texts_of(client, endpoint, stream, extra_body={"structured_outputs": {"regex": REGEX}}):
        assert re.fullmatch(REGEX, text), text
    for text in texts_of(client, endpoint, stream, extra_body={"guided_choice": CHOICES}):
        assert text in CHOICES
    assert len(set(texts_of(client, endpoint, stream, n=8, extra_body={"guided_choice": CHOICES}))) > 1


@pytest.mark.parametrize("fields", [
    {"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
    {"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}},
    {"guided_regex": "(yes|no)!"},
    {"structured_outputs": {"choice": ["up", "down"]}},
    {"guided_grammar": 'root ::= "(" digit+ ")"\ndigit ::= [0-9]'},
    {"structured_outputs": {"grammar": 'root ::= ("ab" | "cd") "."'}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9}},
        "required": ["n"], "additionalProperties": False}}}},
], ids=["guided_json", "structured_outputs.json", "guided_regex", "structured_outputs.choice", "guided_grammar",
        "structured_outputs.grammar", "response_format.json_schema"])
def test_every_request_field_constrains_the_completions_endpoint(server, fields):
    body = {"prompt": "The answer is", "max_tokens": MAX_TOKENS, "temperature": 0, **fields}
    text = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    if "json" in json.dumps(fields):
        value = json.loads(text)
        assert isinstance(value, list) or ("ok" in value or 3 <= value["n"] <= 9)
    elif "grammar" in json.dumps(fields):
        assert re.fullmatch(r"\([0-9]+\)|(ab|cd)\.", text), text
    else:
        assert text in ("yes!", "no!", "up", "down"), text


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(client, offline):
    prompt = "A dictionary maps"
    ref = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].text

    def request(i):
        if i == 0:
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                         extra_body={"guided_regex": "[a-z ]+"})
    plain, *constrained = concurrently(request, range(4))
    assert plain.choices[0].text == ref
    assert all(re.fullmatch("[a-z ]+", c.choices[0].text) for c in constrained)


@pytest.mark.parametrize("fields, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "fooo"}}}},
     "fooo"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "parenthesis"),
    ({"guided_grammar": "root ::= missing_rule"}, "missing_rule"),
    ({"guided_json": "{not json"}, "json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "one structured-output constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    # given but empty: each was a 500 (the spec's kind was looked up by truthiness)
    ({"guided_grammar": ""}, "root"),
    ({"guided_json": ""}, "json"),
    # compiles, but no token can ever be drawn under it
    ({"guided_regex": "[^\\s\\S]"}, "admits no output"),
    ({"structured_outputs": {"grammar": "root ::= root"}}, "admits no output"),
    # bounded: compile time grows faster than the spec
    ({"guided_choice": [f"c{i}" for i in range(3000)]}, "at most 2048"),
    ({"guided_regex": "a" * (200 * 1024)}, "at most"),
    # a schema given as text nests as deep as it likes (an object is held to the body's 200 levels);
    # compile time grows with the cube of the depth: 800 levels took a minute and 1 GB, 5000 hours
    ({"guided_json": '{"type": "array", "items": ' * 1000 + "{}" + "}" * 1000}, "nests"),
])
def test_what_xgrammar_cannot_compile_is_a_400_naming_the_problem(server, fields, words):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/completions", {"prompt": "x"})):
        r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 4, **fields}, timeout=60)
        assert r.status_code == 400, r.text
        assert words.lower() in r.json()["error"]["message"].lower(), r.json()


def test_text_response_format_is_no_constraint(client, offline):
    ref = offline.generate("The function returns", SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    out = client.completions.create(model="tiny", prompt="The function returns", max_tokens=12, temperature=0,
                                    extra_body={"response_format": {"type": "text"}})
    assert out.choices[0].text == ref.text


def test_structured_outputs_survive_preemption(tight_server):
    client = openai_client(tight_server.url, timeout=300)
    before = tight_server.metrics()["nanoserve:num_preemptions_total"]

    def parse(model):
        return model, client.chat.completions.parse(model="tiny", messages=ask(model), response_format=model,
                                                    max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, n=3)
    # whether the cache runs out depends on the draws' lengths and on timing: seeds are tried
    # until a round has preempted (each of them is checked either way)
    for seed in range(3, 8):
        for model, completion in concurrently(parse, MODELS[:6]):
            check_parsed(model, completion)
        if tight_server.metrics()["nanoserve:num_preemptions_total"] > before:
            break
    regex = texts_of(client, "completions", True, n=3, extra_body={"guided_regex": REGEX})
    assert all(re.fullmatch(REGEX, t) for t in regex)
    assert tight_server.metrics()["nanoserve:num_preemptions_total"] > before
    tight_server.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_ignore_eos_stops_where_the_grammar_is_complete(client, stream):
    # vLLM runs on, unconstrained, to max_tokens; here the output stays what the grammar admits
    out = client.completions.create(model="tiny", prompt="The answer is", max_tokens=60, temperature=0, stream=stream,
                                    extra_body={"guided_regex": "[ab]{1,3}", "ignore_eos": True,
                                                "skip_special_tokens": False})
    chunks = list(out) if stream else [out]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert re.fullmatch("[ab]{1,3}", text) and finish == ["stop"], (text, finish)


# an ambiguous grammar: xgrammar's parser takes longer with every token it follows, past the
# engine's bound on the time one matcher may take for one token (engine/grammar_time.py)
SLOWING_GRAMMAR = 'root ::= x "END"\nx ::= [a-z ] | x x | x " " x'


def test_a_grammar_ended_by_a_bound_is_a_400_that_the_client_does_not_retry(server):
    # its own grammar failed it, and would again: a 500 made the openai client send it twice more
    body = {"model": "tiny", "prompt": "The letters are", "max_tokens": 400, "temperature": 1.0, "seed": 3,
            "structured_outputs": {"grammar": SLOWING_GRAMMAR}}
    sent = []
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=2,
                       http_client=httpx.Client(event_hooks={"request": [sent.append]})) as client:
        with pytest.raises(openai.BadRequestError) as failed:
            client.completions.create(**{k: v for k, v in body.items() if k != "structured_outputs"},
                                      extra_body={"structured_outputs": body["structured_outputs"]})
    assert len(sent) == 1
    error = failed.value.body
    assert error["code"] == "request_failed" and error["type"] == "invalid_request_error"
    assert "structured-output grammar took" in error["message"]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    streamed = json.loads(events[-2])["error"]
    assert streamed["type"] == "invalid_request_error" and "structured-output grammar took" in streamed["message"]
    assert server.wait_idle()["nanoserve:kv_cache_blocks_in_use"] == 0


def test_a_schema_keyword_that_would_not_be_enforced_is_a_400_naming_it(client):
    # xgrammar compiled them and left them out: a uniqueItems array came back as [1, 1, 1]
    unique = {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError, match="'uniqueItems' is not enforced") as refused:
        client.chat.completions.create(model="tiny", messages=ask(dict), max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "u", "schema": unique}})
    assert refused.value.body["param"] == "response_format"
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "required": ["a"], "additionalProperties": False}}}
    with pytest.raises(openai.BadRequestError, match="'required' names 'a'"):
        client.chat.completions.create(model="tiny", messages=ask(dict), max_tokens=8, tools=[tool],
                                       tool_choice={"type": "function", "function": {"name": "f"}})
