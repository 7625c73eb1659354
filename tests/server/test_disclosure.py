"""The server tells clients nothing of its machine: no model path, no exception text; the key can stay out of `ps`."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.server.conftest import ServerProcess, serve_refusal, serving, tiny_engine


def test_models_show_the_served_name_and_no_path(server, server_model):
    for path in ("/v1/models", "/v1/models/tiny"):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 200
        assert server_model not in r.text and "assets" not in r.text and "/" not in r.text.replace("\\/", ""), r.text
    assert httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["root"] == "tiny"


def test_an_unexpected_error_is_logged_with_an_id_and_answered_without_its_text(server_model, caplog):

    engine = tiny_engine(server_model)

    def broken_encode(*args, **kwargs):
        raise RuntimeError("secret detail: /srv/private/weights/shard-3.safetensors is corrupt")

    engine.tokenizer.encode = broken_encode
    with serving(engine) as (url, _):
        with caplog.at_level(logging.ERROR, logger="nanoserve.server.errors"):
            r = httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 500
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "internal_error"
    assert "secret" not in r.text and "/srv" not in r.text and "RuntimeError" not in r.text
    error_id = error["message"].split("error id ")[1].split(")")[0]
    assert len(error_id) == 16
    logged = [rec for rec in caplog.records if error_id in rec.getMessage()]
    assert logged and "secret detail" in str(logged[0].exc_info[1])


def test_the_request_after_an_unexpected_error_on_a_kept_alive_connection_is_served(server_model):
    # the server closes the connection after a 500 (Starlette raises the error again); unannounced,
    # the client's next request on it, a good one, got a connection reset

    engine = tiny_engine(server_model)
    encode = engine.tokenizer.encode

    def broken_for_boom(text, *args, **kwargs):
        if text == "boom":
            raise RuntimeError("a fault of the server's")
        return encode(text, *args, **kwargs)

    engine.tokenizer.encode = broken_for_boom
    with serving(engine) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(3):
                failed = client.post("/tokenize", json={"prompt": "boom"})
                assert failed.status_code == 500
                assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 200
                assert failed.headers["connection"] == "close"


@pytest.mark.parametrize("variable", ["NANOSERVE_API_KEY", "VLLM_API_KEY"])
def test_the_api_key_can_come_from_the_environment_and_stays_out_of_ps(server_model, tmp_path, variable):
    proc = ServerProcess(server_model, tmp_path, "--num-kvcache-blocks", "128", "--block-size", "16",
                         env={variable: "key-from-env-42"})
    try:
        assert httpx.get(f"{proc.url}/health", timeout=10).status_code == 200
        r = httpx.get(f"{proc.url}/v1/models", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.get(f"{proc.url}/v1/models", headers={"Authorization": "Bearer key-from-env-42"}, timeout=10)
        assert ok.status_code == 200
        with open(f"/proc/{proc.proc.pid}/cmdline", "rb") as f:
            assert b"key-from-env-42" not in f.read()
    finally:
        proc.stop()


@pytest.mark.parametrize("value", ["", None])
def test_an_empty_or_absent_env_key_leaves_the_server_open(value, monkeypatch):
    from nanoserve.cli import build_parser

    for variable in ("NANOSERVE_API_KEY", "VLLM_API_KEY"):
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
    assert not build_parser().parse_args(["serve"]).api_key


def test_nanoserves_own_variable_wins_over_vllms(monkeypatch):
    from nanoserve.cli import build_parser

    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    monkeypatch.setenv("NANOSERVE_API_KEY", "own-key")
    assert build_parser().parse_args(["serve"]).api_key == "own-key"
    monkeypatch.setenv("NANOSERVE_API_KEY", "")   # set but empty: the next one counts
    assert build_parser().parse_args(["serve"]).api_key == "vllm-key"
    assert build_parser().parse_args(["serve", "--api-key", "flag-key"]).api_key == "flag-key"


@pytest.mark.parametrize("variable", ["NANOSERVE_API_KEY", "VLLM_API_KEY"])
def test_a_blank_key_from_the_environment_is_refused_naming_the_variable(monkeypatch, capsys, variable):
    # the refusal blamed --api-key, a flag the user never passed
    monkeypatch.delenv("NANOSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv(variable, "   ")
    assert f"${variable} is empty, blank or not ASCII" in serve_refusal(monkeypatch, capsys)
    assert "--api-key is empty, blank or not ASCII" in serve_refusal(monkeypatch, capsys, "--api-key", "x\u00e9")
