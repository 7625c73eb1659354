"""vLLM serve flags that deployments carry over (nanoserve/vllm_flags.py, --max-logprobs and
--kv-cache-dtype fp8_e4m3): taken with their meaning here, honoured where they change an answer, and
refused by name, before the model loads, where they ask for what this server cannot do."""

from __future__ import annotations

import httpx
import openai
import pytest

from nanoserve.cli import build_parser
from nanoserve.config import DEFAULT_MODEL, EngineConfig
from nanoserve.engine_flags import engine_kwargs
from tests.server.conftest import ServerProcess, openai_client, serve_refusal

DEPLOYMENT_FLAGS = ("--max-logprobs", "30", "--response-role", "bot", "--tokenizer-mode", "hf", "-pp", "1",
                    "--data-parallel-size", "1", "--swap-space", "4", "--disable-custom-all-reduce",
                    "--disable-sliding-window", "--guided-decoding-backend", "xgrammar",
                    "--enable-prompt-tokens-details", "--no-enable-log-requests", "--return-tokens-as-token-ids")


def test_a_vllm_command_line_serves_with_its_flags_in_effect(server_model, tmp_path):
    with ServerProcess(server_model, tmp_path, *DEPLOYMENT_FLAGS) as server:
        client = openai_client(server.url)
        # --max-logprobs 30: past vLLM's default of 20, every alternative asked for comes back
        done = client.completions.create(model="tiny", prompt="Once upon", max_tokens=3, temperature=0.0,
                                         logprobs=25)
        # (greedy: the chosen token is among the 25, and token ids keep equal texts apart)
        assert [len(top) for top in done.choices[0].logprobs.top_logprobs] == [25, 25, 25]
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2, logprobs=True, top_logprobs=30)
        assert all(len(t.top_logprobs) == 30 for t in chat.choices[0].logprobs.content)
        # --response-role: who the reply speaks as, whole and streamed
        assert chat.choices[0].message.role == "bot"
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2, stream=True)
        assert next(iter(stream)).choices[0].delta.role == "bot"
        # past the cap: a 400 naming the field and the cap, on each endpoint and field
        for call, field in ((lambda: client.completions.create(model="tiny", prompt="x", max_tokens=1, logprobs=31),
                             "logprobs"),
                            (lambda: client.chat.completions.create(
                                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                logprobs=True, top_logprobs=31), "top_logprobs"),
                            (lambda: client.completions.create(model="tiny", prompt="x", max_tokens=1,
                                                               extra_body={"prompt_logprobs": 31}), "prompt_logprobs"),
                            (lambda: client.responses.create(model="tiny", input="x", max_output_tokens=16,
                                                             top_logprobs=31), "top_logprobs")):
            with pytest.raises(openai.BadRequestError) as refused:
                call()
            assert refused.value.body["param"] == field and "at most 30" in refused.value.body["message"]
        # prompt_logprobs -1 (the whole vocabulary) is refused by name
        whole = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"prompt": "x", "max_tokens": 1, "prompt_logprobs": -1})
        assert whole.status_code == 400 and "whole vocabulary" in whole.json()["error"]["message"]
        assert server.wait_idle()["nanoserve:num_requests_running"] == 0
    log = server.log_path.read_text(errors="replace")
    assert "Engine ready" in log and f"request {done.id}" not in log   # --no-enable-log-requests


def test_the_engine_flags_take_vllms_spellings():
    args = build_parser().parse_args(["serve", "--device", "cpu", "--kv-cache-dtype", "fp8_e4m3",
                                      "--max-logprobs", "7"])
    config = EngineConfig(**engine_kwargs(args, DEFAULT_MODEL))
    assert config.kv_cache_dtype == "fp8" and config.max_logprobs == 7
    assert EngineConfig(model=DEFAULT_MODEL, device="cpu", kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
    for bad in (-1, 1025, True):
        with pytest.raises(ValueError, match="max_logprobs must be an integer"):
            EngineConfig(model=DEFAULT_MODEL, device="cpu", max_logprobs=bad)


@pytest.mark.parametrize("given, max_model_len, batched", [
    (["--max-model-len", "1k", "--max-num-batched-tokens", "4K"], 1000, 4096),
    (["--max-model-len", "1.5k", "--max-num-batched-tokens", "2048"], 1500, 2048),
    (["--max-model-len", "1.001k"], 1001, None),   # exact: float arithmetic gave 1,000
    (["--max-model-len", "1K"], 1024, None),
    (["--max-model-len", "auto"], None, None),
    (["--max-model-len", "-1"], None, None),
])
def test_sizes_are_read_as_vllm_writes_them(given, max_model_len, batched):
    # vLLM's human-readable sizes: k counts thousands, K counts 1,024s; auto / -1: the model's context
    args = build_parser().parse_args(["serve", "--device", "cpu", *given])
    assert (args.max_model_len, args.max_num_batched_tokens) == (max_model_len, batched)
    config = EngineConfig(**engine_kwargs(args, DEFAULT_MODEL))
    assert config.max_model_len == (max_model_len or EngineConfig(model=DEFAULT_MODEL, device="cpu").max_model_len)


@pytest.mark.parametrize("flags, message", [
    (["-pp", "2"], "--pipeline-parallel-size 2 is not offered"),
    (["--data-parallel-size", "4"], "--data-parallel-size 4 is not offered"),
    (["--swap-space", "-1"], "--swap-space must be a number of GiB >= 0"),
    (["--swap-space", "nan"], "--swap-space must be a number of GiB >= 0"),
    (["--response-role", ""], "--response-role must be a role name"),
    (["--response-role", " bot"], "--response-role must be a role name"),
    (["--enable-log-requests", "--disable-log-requests"], "contradict each other"),
    (["--guided-decoding-backend", "outlines"], "invalid choice: 'outlines'"),
    (["--tokenizer-mode", "mistral"], "invalid choice: 'mistral'"),
    (["--kv-cache-dtype", "fp8_e5m2"], "invalid choice: 'fp8_e5m2'"),
    (["--max-logprobs", "-1"], "the whole vocabulary, is not offered"),
    (["--max-logprobs", "2000"], "max_logprobs must be an integer in 0-1024"),
    (["--max-model-len", "1.5K"], "a fraction takes a lower-case suffix"),
    (["--max-model-len", "32kb"], "invalid int value: '32kb'"),
    (["--max-num-batched-tokens", "-1"], "invalid int value: '-1'"),
    (["--max-model-len", "9" * 400 + "k"], "invalid int value"),   # float infinity: an OverflowError traceback
    (["--max-num-seqs", "1000000000000", "--max-num-batched-tokens", "1t"], "more than 65536 sequences a step"),
])
def test_what_this_server_cannot_do_is_refused_before_the_model_loads(monkeypatch, capsys, flags, message):
    assert message in serve_refusal(monkeypatch, capsys, *flags)


@pytest.mark.parametrize("flags, message", [
    (["--quantization", "awq"], "argument --quantization/-q: invalid choice: 'awq'"),
    (["-q", "fp8"], "quantization 'fp8' was asked for, but the checkpoint is not quantized, and weights are not"),
    (["--enable-lora"], "--enable-lora is not supported by this server: LoRA adapters"),
    (["-O3"], "-O is not supported by this server"),
    (["--limit-mm-per-prompt", "image=2"], "this server serves text-only models"),
    (["--task", "embed"], "argument --task: invalid choice: 'embed'"),
])
def test_vllm_flags_for_what_this_server_does_not_do_are_refused_by_name(monkeypatch, capsys, flags, message):
    # argparse's "unrecognized arguments" named the flag but not why, nor what to do instead
    assert message in serve_refusal(monkeypatch, capsys, *flags)


def test_a_vllm_command_line_asking_for_generation_is_taken():
    args = build_parser().parse_args(["serve", "--task", "generate", "--runner", "auto"])
    assert (args.task, args.runner) == ("generate", "auto") and args.quantization is None
