"""Flags a vLLM command line brings along: HTTPS (--ssl-*), vLLM's spellings of prefix caching and
chunked prefill, --trust-remote-code, --disable-log-stats, --uvicorn-log-level, --disable-fastapi-docs,
--return-tokens-as-token-ids, CORS's --allowed-methods/--allowed-headers/--allow-credentials,
--enable-request-id-headers, --enable-force-include-usage, --disable-uvicorn-access-log,
--stream-interval and --metrics-prefix vllm."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import ssl
import time
from pathlib import Path

import httpx
import openai
import pytest

from nanoserve.cli import build_parser, main
from nanoserve.engine_flags import engine_kwargs
from nanoserve.config import DEFAULT_MODEL, EngineConfig
from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.server.app import build_app
from tests.server.conftest import REPO, ServerProcess, in_process_server, metrics_text, serve_refusal, tiny_engine

TLS = REPO / "tests" / "assets" / "tls"
CERT, KEY = str(TLS / "cert.pem"), str(TLS / "key.pem")
TRUSTS_CERT = ssl.create_default_context(cafile=CERT)   # a client that trusts the test certificate


def test_https_serves_the_openai_client_and_the_vllm_flags_take_effect(server_model, tmp_path):
    with ServerProcess(server_model, tmp_path, "--ssl-certfile", CERT, "--ssl-keyfile", KEY,
                       "--no-enable-prefix-caching", "--uvicorn-log-level", "warning", "--disable-fastapi-docs",
                       "--return-tokens-as-token-ids", verify=TRUSTS_CERT) as server:
        assert server.url.startswith("https://")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none",
                               http_client=httpx.Client(verify=TRUSTS_CERT))
        prompt = "The same long prompt, twice over, " * 8
        for _ in range(2):
            done = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0.0)
            assert done.usage.completion_tokens == 4
        # prefix caching is off: the second prompt found nothing of the first in the cache
        metrics = metrics_text(server.url, verify=TRUSTS_CERT)
        assert "nanoserve:prefix_cache_hits_total 0.0" in metrics
        assert "nanoserve:prefix_cache_queries_total 0.0" in metrics
        # logprobs name tokens by id, unless a request says otherwise
        by_id = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0.0, logprobs=2)
        named = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0.0, logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": False})
        assert all(t.startswith("token_id:") for t in by_id.choices[0].logprobs.tokens)
        assert not any(t.startswith("token_id:") for t in named.choices[0].logprobs.tokens)
        assert [int(t.removeprefix("token_id:")) for t in by_id.choices[0].logprobs.tokens] == \
            client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0.0,
                                      extra_body={"return_token_ids": True}).choices[0].token_ids
        for path in ("/docs", "/redoc", "/openapi.json"):
            gone = httpx.get(f"{server.url}{path}", verify=TRUSTS_CERT, timeout=10)
            assert gone.status_code == 404 and "error" in gone.json(), path
        with pytest.raises(httpx.TransportError):   # plain HTTP gets no answer from a TLS port
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError):     # nor does a client that does not trust the certificate
            httpx.get(f"{server.url}/health", timeout=5)
    log = server.log_path.read_text(errors="replace")
    assert f"on https://127.0.0.1:{server.port}" in log
    # uvicorn at warning: its access lines are gone, nanoserve's own info lines are not
    assert '"POST /v1/completions HTTP/1.1" 200' not in log and "Engine ready" in log


def test_https_stops_at_once_beside_an_idle_client_and_still_drains_a_stream_in_flight(server_model, tmp_path):
    # an idle pooled connection (every openai client keeps one) held the stop for 30 s: its TLS
    # close waited for the client's close_notify, which a pool never sends
    server = ServerProcess(server_model, tmp_path, "--ssl-certfile", CERT, "--ssl-keyfile", KEY, verify=TRUSTS_CERT)
    idle = httpx.Client(verify=TRUSTS_CERT)
    try:
        assert idle.get(f"{server.url}/health").status_code == 200   # its connection stays in the pool
        body = {"prompt": "A list", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.Client(verify=TRUSTS_CERT, timeout=60) as client, \
                client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            events = (line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))
            first = next(events)
            server.proc.send_signal(signal.SIGTERM)
            stopping = time.monotonic()
            received = [first, *events]
        assert received[-1] == "[DONE]"
        assert json.loads(received[-2])["choices"][0]["finish_reason"] == "length"
        assert sum(json.loads(e)["choices"][0]["text"] != "" for e in received[:-1]) > 100
        assert server.proc.wait(15) == 0, server.log_tail()
        assert time.monotonic() - stopping < 10
    finally:
        idle.close()
        server.stop()


@pytest.mark.parametrize("flags, message", [
    (["--ssl-certfile", CERT], "HTTPS needs both --ssl-certfile and --ssl-keyfile"),
    (["--ssl-certfile", CERT, "--ssl-keyfile", CERT], "cannot use --ssl-certfile"),
    (["--ssl-certfile", CERT, "--ssl-keyfile", "/no/such/key.pem"], "No such file or directory"),
    (["--ssl-ca-certs", CERT], "--ssl-ca-certs and --ssl-cert-reqs apply to HTTPS"),
    (["--ssl-certfile", CERT, "--ssl-keyfile", KEY, "--ssl-cert-reqs", "2"], "give --ssl-ca-certs"),
])
def test_bad_certificate_flags_exit_before_the_model_loads(monkeypatch, capsys, flags, message):
    assert message in serve_refusal(monkeypatch, capsys, *flags)


def test_an_encrypted_key_is_refused_instead_of_asking_for_its_password(capsys, monkeypatch):
    encrypted = str(TLS / "encrypted-key.pem")
    refusal = serve_refusal(monkeypatch, capsys, "--ssl-certfile", CERT, "--ssl-keyfile", encrypted)
    assert "the private key is encrypted" in refusal


def _config(*flags: str) -> EngineConfig:
    args = build_parser().parse_args(["generate", "hi", "--device", "cpu", *flags])
    return EngineConfig(**engine_kwargs(args, None))


def test_vllm_spellings_of_prefix_caching_and_chunked_prefill(capsys):
    assert _config().enable_prefix_caching and _config("--enable-prefix-caching").enable_prefix_caching
    assert not _config("--no-enable-prefix-caching").enable_prefix_caching
    assert not _config("--no-prefix-caching").enable_prefix_caching
    budget = ("--max-model-len", "1024", "--max-num-batched-tokens", "512")
    assert _config(*budget).enable_chunked_prefill
    # without chunks a prompt runs whole: a step's token budget must hold the longest one
    with pytest.raises(ValueError, match="unless chunked prefill is enabled"):
        _config(*budget, "--no-enable-chunked-prefill")
    off = _config("--max-model-len", "1024", "--no-enable-chunked-prefill")
    assert not off.enable_chunked_prefill and off.max_num_batched_tokens >= 1024
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", "--device", "cpu", "--no-prefix-caching", "--enable-prefix-caching"])
    assert exit_.value.code == 2 and "contradict each other" in capsys.readouterr().err


def _model_with_its_own_tokenizer_code(folder: Path, model: str) -> str:
    shutil.copytree(model, folder)
    (folder / "marked_tokenizer.py").write_text("from transformers import PreTrainedTokenizerFast\n\n\n"
                                               "class MarkedTokenizer(PreTrainedTokenizerFast):\n    marked = True\n")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "marked_tokenizer.MarkedTokenizer"]}
    config_path.write_text(json.dumps(config))
    return str(folder)


def test_trust_remote_code_lets_the_model_folder_bring_its_tokenizer_class(server_model, tmp_path):
    model = _model_with_its_own_tokenizer_code(tmp_path / "model", server_model)
    for flags, marked in (([], False), (["--trust-remote-code"], True)):
        args = build_parser().parse_args(["serve", model, "--device", "cpu", *flags])
        engine = AsyncEngine(EngineConfig(**engine_kwargs(args, args.model)))   # the server's tokenizer
        assert getattr(engine.tokenizer, "marked", False) is marked


def test_disable_log_stats_silences_the_periodic_engine_line(server_model, monkeypatch, caplog):
    import nanoserve.server.app as app_module
    from nanoserve.server.state import ServerSettings

    monkeypatch.setattr(app_module, "STATS_INTERVAL_S", 0.05)
    lines = {}
    for log_stats in (True, False):
        caplog.clear()
        engine = tiny_engine(server_model)
        settings = ServerSettings(served_model_names=["tiny"], log_stats=log_stats)
        with caplog.at_level(logging.INFO, logger="nanoserve.server.app"):
            with in_process_server(app_module.build_app(engine, settings)) as (url, _):
                httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 200,
                                                          "ignore_eos": True}, timeout=60).raise_for_status()
        lines[log_stats] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Engine: ")]
    assert lines[True] and not lines[False]


def test_override_generation_config_sets_defaults_over_the_models_file(server_model, tmp_path):
    from nanoserve.generation_defaults import generation_overrides, sampling_defaults
    from nanoserve.server.state import ServerSettings

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    overrides = generation_overrides('{"temperature": 0, "top_p": 0.5}')
    assert sampling_defaults(str(tmp_path), "auto", overrides) == {"temperature": 0, "top_k": 20, "top_p": 0.5}
    assert sampling_defaults(str(tmp_path), "vllm", overrides) == {"temperature": 0, "top_p": 0.5}
    # served: a request that leaves temperature out is greedy under the override, one that sets it is not
    settings = ServerSettings(served_model_names=["tiny"], generation_overrides=generation_overrides(
        '{"temperature": 0.0}'))
    body = {"model": "tiny", "prompt": "The list of", "max_tokens": 24, "ignore_eos": True}
    with in_process_server(build_app(tiny_engine(server_model), settings)) as (url, _):
        unset = [httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                 for _ in range(2)]
        greedy = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0.0}, timeout=60).json()
        hot = [httpx.post(f"{url}/v1/completions", json={**body, "temperature": 2.0, "seed": seed}, timeout=60).json()
               for seed in range(3)]
    assert unset == [greedy["choices"][0]["text"]] * 2
    assert any(h["choices"][0]["text"] != unset[0] for h in hot)


def test_max_new_tokens_of_the_generation_config_caps_every_request_as_vllms_does(server_model, tmp_path):
    from nanoserve.generation_defaults import generation_overrides, sampling_defaults
    from nanoserve.server.state import ServerSettings

    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    assert sampling_defaults(str(tmp_path)) == {"max_tokens": 3}
    assert generation_overrides('{"max_new_tokens": 2}') == {"max_tokens": 2}
    for overrides, cap in (({}, 3), ({"max_tokens": 2}, 2)):
        settings = ServerSettings(served_model_names=["tiny"], generation_config=str(tmp_path),
                                  generation_overrides=overrides)
        with in_process_server(build_app(tiny_engine(server_model), settings)) as (url, _):
            for body in ({}, {"max_tokens": 10}, {"max_tokens": 1}):
                done = httpx.post(f"{url}/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": "The list of", "ignore_eos": True, **body}).json()
                assert done["usage"]["completion_tokens"] == min(cap, body.get("max_tokens", cap)), (cap, body)
            chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}).json()
            assert chat["usage"]["completion_tokens"] == cap


@pytest.mark.parametrize("value, message", [
    ("{temperature: 0}", "is not JSON"),
    ("[0.5]", "is not a JSON object"),
    ('{"max_tokens": 5}', "cannot set max_tokens"),
    ('{"temperature": "low"}', "temperature must be a number"),
    ('{"top_p": true}', "top_p must be a number"),
    ('{"temperature": -1}', "--override-generation-config: temperature"),
    ('{"top_p": 0}', "--override-generation-config: top_p"),
])
def test_a_bad_override_generation_config_exits_before_the_model_loads(monkeypatch, capsys, value, message):
    assert message in serve_refusal(monkeypatch, capsys, "--override-generation-config", value)


@pytest.mark.parametrize("found, expected", [
    ({"top_k": 20.0, "temperature": 1}, {"top_k": 20, "temperature": 1.0}),   # numbers as the engine takes them
    ({"top_k": 0}, {"top_k": -1}),                                            # off, as transformers reads 0
])
def test_a_model_folders_defaults_are_taken_as_a_request_would_take_them(tmp_path, found, expected):
    from nanoserve.generation_defaults import sampling_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(found))
    defaults = sampling_defaults(str(tmp_path))
    assert defaults == expected and all(type(defaults[k]) is type(v) for k, v in expected.items())


@pytest.mark.parametrize("content, message", [
    ('{"top_k": 2.5}', "top_k must be an integer, got 2.5"),
    ('{"top_p": "0.9"}', "top_p must be a number"),
    ('{"temperature": -0.5}', "temperature must be >= 0"),
    ('{"top_k": 20,}', "is not JSON"),
    ('[0.9]', "is not a JSON object"),
])
def test_a_model_folder_whose_defaults_no_request_could_take_is_refused_at_startup(tmp_path, monkeypatch, capsys,
                                                                                   content, message):
    # a top_k of 2.5 reached the engine core, which could not decode the request and dropped it: the
    # request never ended, and neither did any other that left top_k out
    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, model)
    (model / "generation_config.json").write_text(content)
    refusal = serve_refusal(monkeypatch, capsys, str(model))
    assert message in refusal and "--generation-config vllm" in refusal
    assert "--generation-config vllm" not in serve_refusal(monkeypatch, capsys, str(model), "--generation-config",
                                                           "vllm", "--port", "-1")   # ignored: the next check


@pytest.mark.parametrize("content", ["{bad", '{"model_type": "qwen3", "hidden_size": "wide"}', "[]"])
def test_a_model_folder_whose_config_cannot_be_read_is_refused_at_startup(tmp_path, monkeypatch, capsys, content):
    # a config.json transformers cannot read ended serve in a traceback (OSError, or the Hub's
    # StrictDataclassFieldValidationError), not a refusal naming the file
    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, model)
    (model / "config.json").write_text(content)
    refusal = serve_refusal(monkeypatch, capsys, str(model))
    assert f"{model / 'config.json'} cannot be read as a model's config" in refusal


def test_cors_request_id_usage_access_log_stream_interval_and_metrics_flags(server_model, tmp_path):
    origin = "https://app.example"
    with ServerProcess(server_model, tmp_path, "--allowed-origins", origin, "--allow-credentials",
                       "--allowed-methods", "GET", "POST", "--allowed-headers", "Authorization", "Content-Type",
                       "--enable-request-id-headers", "--enable-force-include-usage",
                       "--disable-uvicorn-access-log", "--stream-interval", "4", "--metrics-prefix", "vllm") as server:
        # CORS: the preflight names what the flags allow, credentials included
        preflight = httpx.options(f"{server.url}/v1/completions", timeout=10, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "Authorization"})
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == origin
        assert preflight.headers["access-control-allow-credentials"] == "true"
        assert set(preflight.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
        refused = httpx.options(f"{server.url}/v1/completions", timeout=10, headers={
            "Origin": origin, "Access-Control-Request-Method": "DELETE"})
        assert refused.status_code == 400

        # X-Request-Id: the client's own, else a new one on each response, errors included
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        given = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Request-Id": "trace-42"}, timeout=60)
        assert given.status_code == 200 and given.headers["x-request-id"] == "trace-42"
        fresh = [httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).headers["x-request-id"]
                 for _ in range(2)]
        assert fresh[0] != fresh[1] and all(len(i) == 32 for i in fresh)
        bad = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": -1}, timeout=60)
        assert bad.status_code == 400 and len(bad.headers["x-request-id"]) == 32
        assert httpx.get(f"{server.url}/health", timeout=10).headers["x-request-id"]

        # usage ends every stream, asked for or not; continuous usage still needs asking
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        chunks = list(client.completions.create(model="tiny", prompt="Hi", max_tokens=3, stream=True))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        assert all(c.usage is None for c in chunks[:-1])
        chat = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=3, stream=True,
                                                   stream_options={"include_usage": False}))
        assert chat[-1].usage is not None and chat[-1].usage.completion_tokens == 3

        # --stream-interval 4: the first token at once, then events of at least 4 tokens. The first
        # event is not held for 4; a reader that wakes late (a loaded machine) may find the next
        # step's token beside it (test_request_stream.py pins the first token alone)
        ask = dict(model="tiny", prompt="Once upon a time", max_tokens=23, temperature=0.0,
                   extra_body={"ignore_eos": True, "return_token_ids": True})
        events = [c for c in client.completions.create(**ask, stream=True) if c.choices]
        sizes = [len(c.choices[0].token_ids) for c in events if c.choices[0].token_ids]
        assert sizes[0] < 4 and sum(sizes) == 23 and all(size >= 4 for size in sizes[1:-1]), sizes
        assert "".join(c.choices[0].text for c in events) == client.completions.create(**ask).choices[0].text

        # /metrics under vLLM's names, as autoscalers and routers read them
        metrics = metrics_text(server.url)
        for line in ("# TYPE vllm:num_requests_waiting gauge", "vllm:num_requests_running 0.0",
                     "vllm:kv_cache_usage_perc ", 'vllm:request_success_total{finished_reason="length"}',
                     "vllm:time_to_first_token_seconds_bucket{"):
            assert line in metrics, line
        assert "nanoserve:" not in metrics
    log = server.log_path.read_text(errors="replace")
    # uvicorn's access lines are gone, nanoserve's own line per request is not
    assert '"POST /v1/completions HTTP/1.1" 200' not in log and "request cmpl-trace-42: " in log
