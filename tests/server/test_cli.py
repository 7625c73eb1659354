"""`nanoserve generate` and `nanoserve serve`'s flags; `import nanoserve` stays free of the web stack."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from nanoserve import SamplingParams
from nanoserve.cli import build_parser, main
from nanoserve.config import DEFAULT_MODEL
from tests.server.conftest import DEVICE, REPO, ServerProcess, serve_refusal

ISSUE_FLAGS = ["--host", "--port", "--served-model-name", "--api-key", "--max-model-len", "--max-num-seqs",
               "--max-num-batched-tokens", "--gpu-memory-utilization", "--max-queue-len", "--dtype", "--device",
               "--attention-backend", "--enforce-eager", "--block-size", "--num-kvcache-blocks", "--seed",
               "--load-format", "--allowed-origins"]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_generate_prints_the_offline_completion(offline):
    prompt = "The function returns"
    expected = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].text
    result = run_cli("generate", prompt, "--max-tokens", "12", "--device", DEVICE)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"


def test_serve_accepts_every_flag_of_the_issue(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert [f for f in ISSUE_FLAGS if f not in help_text] == []
    args = build_parser().parse_args(["serve", "/models/x", "--served-model-name", "a", "b", "--enforce-eager",
                                      "--allowed-origins", "https://example.org", "--max-queue-len", "7"])
    assert (args.model, args.served_model_name, args.enforce_eager) == ("/models/x", ["a", "b"], True)
    assert (args.allowed_origins, args.max_queue_len) == (["https://example.org"], 7)


def test_a_bad_flag_value_exits_with_a_message_naming_the_fix():
    result = run_cli("serve", "--block-size", "3", "--device", "cpu", "--port", "1")
    assert result.returncode == 2
    assert "block_size must be a power of two, got 3" in result.stderr


def test_the_console_script_is_declared():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^\[project\.scripts\]\nnanoserve = "nanoserve\.cli:main"$', pyproject, re.M)


def test_import_nanoserve_does_not_load_the_web_stack():
    code = ("import sys, nanoserve; bad = [m for m in ('fastapi', 'uvicorn', 'sse_starlette', 'starlette', "
            "'nanoserve.server') if m in sys.modules]; print(bad)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.stdout.strip() == "[]", result.stderr


def test_the_server_never_imports_the_runner():
    for path in (REPO / "nanoserve" / "server").glob("*.py"):
        assert "nanoserve.runner" not in path.read_text(), f"{path.name} reaches into the runner"


def test_chat_template_flag_replaces_the_tokenizers_template_and_gets_the_requests_variables(server_model, tmp_path, offline):
    import httpx

    from tests.server.conftest import ServerProcess

    template = tmp_path / "plain.jinja"
    template.write_text("{% if reasoning_effort is defined %}<{{ reasoning_effort }}>{% endif %}"
                        "{% for d in documents or [] %}({{ d['title'] }}: {{ d['text'] }}){% endfor %}"
                        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    proc = ServerProcess(server_model, tmp_path, "--num-kvcache-blocks", "256", "--chat-template", str(template))
    messages = [{"role": "user", "content": "A list is"}]

    def prompt_of(**fields) -> list[int]:
        r = httpx.post(f"{proc.url}/v1/chat/completions", timeout=30,
                       json={"messages": messages, "max_tokens": 1, "return_token_ids": True, **fields})
        assert r.status_code == 200, r.text
        return r.json()["prompt_token_ids"]

    try:
        body = httpx.post(f"{proc.url}/tokenize", json={"messages": messages}, timeout=30).json()
        # OpenAI's reasoning_effort reaches the template as a variable, as vLLM passes it; the
        # request's chat_template_kwargs win over it
        low = prompt_of(reasoning_effort="low")
        high = prompt_of(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
        refused = httpx.post(f"{proc.url}/v1/chat/completions", timeout=30,
                             json={"messages": messages, "reasoning_effort": "extreme"})
        # vLLM's documents reach retrieval-augmented templates as `documents`
        grounded = prompt_of(documents=[{"title": "Lists", "text": "ordered"}])
        beams = httpx.post(f"{proc.url}/v1/chat/completions", timeout=30,
                           json={"messages": messages, "use_beam_search": True, "length_penalty": 0.5})
    finally:
        proc.stop()
    assert body["tokens"] == offline.tokenizer.encode("[user] A list is\n", add_special_tokens=False)
    assert low == offline.tokenizer.encode("<low>[user] A list is\n", add_special_tokens=False)
    assert high == offline.tokenizer.encode("<high>[user] A list is\n", add_special_tokens=False)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"
    assert grounded == offline.tokenizer.encode("(Lists: ordered)[user] A list is\n", add_special_tokens=False)
    assert beams.status_code == 400 and beams.json()["error"]["param"] == "use_beam_search", beams.text


@pytest.mark.parametrize("source, extra", [("--config", ()), ("--model", ()), ("--model", ("--json-schema",))],
                         ids=["--config", "--model", "--json-schema"])
def test_bench_throughput_runs_the_workload_and_counts_every_token(source, extra):
    from nanoserve import DEFAULT_MODEL

    target = f"{DEFAULT_MODEL}/config.json" if source == "--config" else DEFAULT_MODEL
    out = run_cli("bench", "throughput", source, target, "--device", "cpu", "--num-seqs", "4",
                  "--min-input-len", "40", "--max-input-len", "80", "--min-output-len", "3", "--max-output-len", "8",
                  "--max-token-id", "4000", "--max-model-len", "256", "--max-num-batched-tokens", "256",
                  "--max-num-seqs", "8", *extra)
    assert out.returncode == 0, out.stderr[-2000:]
    if extra:  # constrained, every request still runs to its max_tokens (counted in the line below)
        assert re.search(r"^grammar compile: \d+ ms for a schema of 200 fields", out.stdout, re.M)
        assert "json_schema" in out.stdout
    runs = re.findall(r"^throughput: (\d+) output tokens in [\d.]+ s = \d+ tok/s \(4 seqs.*run (\d) of 2: "
                      r"(\d+) of (\d+) prompt tokens computed\)$", out.stdout, re.M)
    assert [run for _, run, _, _ in runs] == ["1", "2"], out.stdout
    for tokens, _, _, _ in runs:
        assert 12 <= int(tokens) <= 32  # 4 requests of 3 to 8 tokens, each counted
    (_, _, cold, prompt_tokens), (_, _, warm, _) = runs
    assert int(cold) == int(prompt_tokens) and int(warm) < int(cold)  # run 2 finds the prompts in the prefix cache


def test_bench_throughput_trace_splits_prefill_steps_from_decode_steps(tmp_path):
    from nanoserve import DEFAULT_MODEL

    out = run_cli("bench", "throughput", "--model", DEFAULT_MODEL, "--device", "cpu", "--num-seqs", "4",
                  "--min-input-len", "40", "--max-input-len", "80", "--min-output-len", "6", "--max-output-len", "8",
                  "--max-token-id", "4000", "--max-model-len", "256", "--max-num-batched-tokens", "256",
                  "--max-num-seqs", "8", "--runs", "1", "--trace", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"kv auto in \d+ blocks", out.stdout), out.stdout
    text = (tmp_path / "step_times.txt").read_text()
    steps, prefill = map(int, re.match(r"(\d+) steps, [\d.]+ s: (\d+) launching prompt tokens", text).groups())
    # 4 prompts of 40-80 tokens fit one 256-token step; then 5-7 decode-only steps at most 4 running
    assert 1 <= prefill <= 2 and steps - prefill >= 5, text
    decode_rows = re.findall(r"^\s+(\d+)\s+(\d+)\s", text, re.M)
    assert [bucket for bucket, _ in decode_rows] == ["64"] and int(decode_rows[0][1]) == steps - prefill, text


def test_version_and_python_dash_m_nanoserve():
    from nanoserve import __version__

    result = subprocess.run([sys.executable, "-m", "nanoserve", "--version"], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"nanoserve {__version__}", result.stderr
    assert run_cli("--version").stdout.strip() == f"nanoserve {__version__}"


@pytest.mark.parametrize("command", [["serve", "--help"], ["generate", "--help"], ["--help"]])
def test_help_answers_in_under_a_second_without_importing_torch(command):
    # CPU seconds, not wall seconds: what --help costs, whatever else the machine is running
    code = ("import sys, time; start = time.process_time(); from nanoserve.cli import main\n"
            f"try: main({command!r})\nexcept SystemExit as e: assert e.code == 0, e.code\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules, round(time.process_time() - start, 3))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    torch_loaded, transformers_loaded, seconds = result.stdout.strip().splitlines()[-1].split()
    assert (torch_loaded, transformers_loaded) == ("False", "False"), result.stderr
    assert float(seconds) < 1.0


@pytest.mark.parametrize("argv, says", [
    (["serve", "/no/such/folder"], "does not exist"),
    (["serve", "--port", "70000"], "--port must be in 0-65535"),
    (["serve", "--api-key", " "], "is empty, blank or not ASCII"),
    (["serve", "--enable-auto-tool-choice"], "needs --tool-call-parser"),
    (["generate", "--model", "./no/such/folder", "hi"], "does not exist"),
])
def test_a_bad_model_or_flag_is_refused_before_torch_loads(argv, says):
    # a typo in a deployment's command line is answered at once, not after seconds of imports
    code = ("import sys; from nanoserve.cli import main\n"
            f"try: main({argv!r})\nexcept SystemExit as e: assert e.code == 2, e.code\n"
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert says in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def test_help_shows_the_defaults():
    serve_help = run_cli("serve", "--help", timeout=60).stdout
    for text in ("(default: 8000)", "(default: 0.0.0.0)", "(default: 1024)", "(default: 33554432)",
                 "(default: 256)", "(default: 4096)", "(default: 5.0)", "(default: 10.0)", "(default: 0.9)"):
        assert text in " ".join(serve_help.split()), text
    assert "(default: None)" not in serve_help and "(default: False)" not in serve_help


def test_bench_help_lists_the_benchmarks_and_each_has_its_own():
    result = run_cli("bench", "--help", timeout=60)
    assert result.returncode == 0 and "throughput" in result.stdout and "serving" in result.stdout, result.stderr
    for kind, flag in (("throughput", "--num-seqs"), ("serving", "--url")):
        result = run_cli("bench", kind, "--help", timeout=120)
        assert result.returncode == 0 and f"nanoserve bench {kind}" in result.stdout and flag in result.stdout, kind


def test_bench_throughput_outside_the_repository_names_the_missing_config(tmp_path):
    # its default --config is the repository's file: elsewhere it was a FileNotFoundError traceback
    result = subprocess.run([sys.executable, "-m", "nanoserve.cli", "bench", "throughput", "--num-seqs", "2"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2 and "--config 'bench/configs/qwen3-0.6b.json' is not a file" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_checks_its_flags_before_loading_weights(monkeypatch, capsys):
    import nanoserve.engine.llm

    def no_loading(*args, **kwargs):
        raise AssertionError("the weights were loaded before the flags were checked")

    monkeypatch.setattr(nanoserve.engine.llm, "LLM", no_loading)
    for flags, message in ((["--temperature", "-1"], "temperature must be >= 0"),
                           (["--max-tokens", "0"], "max_tokens must be in [1,")):
        with pytest.raises(SystemExit) as exit_:
            main(["generate", "hi", *flags])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "--port must be in 0-65535, got 70000"),
    (["--port", "-1"], "--port must be in 0-65535, got -1"),
    (["--engine-stall-timeout", "0.5"], "--engine-stall-timeout must be at least 3 seconds"),
    (["--engine-stall-timeout", "nan"], "--engine-stall-timeout must be at least 3 seconds"),
    (["--engine-death-grace-period", "nan"], "--engine-death-grace-period must be a finite number of seconds >= 0"),
    (["--engine-death-grace-period", "inf"], "--engine-death-grace-period must be a finite number of seconds >= 0"),
    (["--engine-death-grace-period", "-5"], "--engine-death-grace-period must be a finite number of seconds >= 0"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be a number of seconds >= 0"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be a number of seconds >= 0"),
    # a value a header cannot carry (a stray newline from a quoted variable, or a character past
    # latin-1) failed every CORS preflight with an empty reply, not the server's start
    # a template that cannot compile, or a file that is not there (read as the template's text),
    # served every chat request a 400 that blamed its messages
    (["--chat-template", "{% for %}"], "--chat-template is not a Jinja template that compiles"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template '/no/such/template.jinja' is not a file"),
    (["--allowed-origins", "*", "--allowed-headers", "X-Foo\nX-Bar"], "--allowed-headers 'X-Foo\\nX-Bar'"),
    (["--allowed-origins", "*", "--allowed-methods", "GET", "PO ST"], "--allowed-methods 'PO ST'"),
    (["--allowed-origins", "https://b\u00e9\u4e2d.example"], "--allowed-origins 'https://b\u00e9\u4e2d.example'"),
    # each was a traceback: inf overflowed the byte count, a size of 0 divided the CPU's threads
    (["--max-undelivered-mb", "inf"], "--max-undelivered-mb) must be a finite positive number of MiB, got inf"),
    (["--tensor-parallel-size", "0"], "tensor_parallel_size"),
    # /v1/models listed an id that no client could send
    (["--served-model-name", "a", " "], "--served-model-name ' ' is not a name"),
    (["--served-model-name", "a\nb"], "--served-model-name 'a\\nb' is not a name"),
])
def test_serve_checks_its_flags_before_loading_weights(monkeypatch, capsys, flags, message):
    assert message in serve_refusal(monkeypatch, capsys, *flags)


def test_serve_takes_the_model_as_a_flag_too(server_model):
    args = build_parser().parse_args(["serve", "--model", "/models/x"])
    assert (args.model, args.model_flag) == (None, "/models/x")
    # the flag reaches the engine: a missing folder is named in the error, before anything loads
    result = run_cli("serve", "--model", "/no/such/model", "--device", "cpu", timeout=60)
    assert result.returncode == 2 and "'/no/such/model' does not exist" in result.stderr
    result = run_cli("serve", "/a", "--model", "/b", timeout=60)
    assert result.returncode == 2 and "given twice" in result.stderr


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_tokenizer_that_cannot_be_loaded_is_refused_naming_it(command):
    # transformers' OSError (a path that is no folder is read as a Hub id, and refused as one) was a
    # traceback, from the front end's AsyncEngine or the offline engine
    args = ["--port", "0"] if command == "serve" else ["hi"]
    result = run_cli(command, *args, "--device", "cpu", "--tokenizer", "/no/such/tokenizer", timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert ("Tokenizer folder '/no/such/tokenizer' (--tokenizer, else the model folder's own) does not exist"
            in result.stderr)
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_folder_without_tokenizer_files_is_refused_at_start(command, tmp_path):
    # transformers loads it as an empty tokenizer: the server came up healthy and refused every prompt as empty
    (tmp_path / "config.json").write_text((Path(DEFAULT_MODEL) / "config.json").read_text())
    args = ["--port", "0"] if command == "serve" else ["hi"]
    result = run_cli(command, *args, "--device", "cpu", "--tokenizer", str(tmp_path), timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "has no vocabulary: the folder holds no tokenizer files" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_model_the_engine_cannot_load_ends_serve_with_its_reason_and_no_traceback(tmp_path):
    # the reason sat in the middle of two tracebacks, some 55 lines, the last of them starlette's frames
    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"]}))
    result = run_cli("serve", str(model), "--port", "0", "--device", "cpu", timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]   # uvicorn's "startup failed"
    assert "The engine failed to start: Unknown architecture 'FooForCausalLM'" in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") < 12, result.stderr


def test_an_inherited_prometheus_multiproc_dir_leaves_a_single_front_end_alone(server_model, tmp_path):
    # prometheus_client took it up: a folder that did not exist was a traceback at start, one that
    # did filled with the server's files
    prom = tmp_path / "prom"
    with ServerProcess(server_model, tmp_path, env={"PROMETHEUS_MULTIPROC_DIR": str(prom)}) as proc:
        r = httpx.post(f"{proc.url}/v1/completions", json={"model": "tiny", "prompt": "A list", "max_tokens": 3,
                                                           "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        assert proc.metrics()["nanoserve:generation_tokens_total"] == 3
    assert not prom.exists()


def test_serve_refuses_cuda_when_there_is_none_instead_of_falling_back():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_cli("serve", "--device", "cuda", "--port", "1", timeout=120)
    assert result.returncode == 2
    assert "device='cuda' was asked for but torch sees no CUDA device" in result.stderr
    assert "--gpus all" in result.stderr


def test_a_served_model_name_given_twice_is_listed_once(monkeypatch):
    import nanoserve.server.app

    served = []
    monkeypatch.setattr(nanoserve.server.app, "serve", lambda config, settings, *a: served.append(settings) or a[-1].close())
    main(["serve", "--device", "cpu", "--host", "127.0.0.1", "--port", "0", "--served-model-name", "a", "b", "a"])
    assert served[0].served_model_names == ["a", "b"]
