"""vLLM's `serve --config FILE.yaml`: flags from a YAML file, the command line's own winning; a
file that cannot be read as flags stops serve before anything loads."""

from __future__ import annotations

import openai
import pytest

from nanoserve.cli import build_parser
from nanoserve.serve_config import expand_config
from tests.server.conftest import ServerProcess, openai_client, serve_refusal


def serve_args(tmp_path, yaml_text: str, *argv: str):
    path = tmp_path / "config.yaml"
    path.write_text(yaml_text)
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    return parser.parse_args(["serve", *expand_config([*argv[:1], "--config", str(path), *argv[1:]], serve)])


def test_the_files_flags_are_read_as_the_command_lines_and_the_command_line_wins(tmp_path):
    args = serve_args(tmp_path, """
model: /models/from-file
max_model_len: 1024
max-num-seqs: 7
port: 9000
enable-prefix-caching: false
trust-remote-code: true
enforce-eager: false
served-model-name: [a, b]
override-generation-config: {temperature: 0.5}
seed: null
""", "--port", "8123")
    assert args.model_flag == "/models/from-file" and args.port == 8123
    assert args.served_model_name == ["a", "b"] and args.trust_remote_code and not args.enforce_eager
    assert args.enable_prefix_caching is False   # false writes --no-enable-prefix-caching
    assert str(args.max_model_len) == "1024" and args.max_num_seqs == 7
    assert '"temperature": 0.5' in args.override_generation_config
    # the command line's model wins, by argument or by --model
    assert serve_args(tmp_path, "model: /from-file\n", "/given").model == "/given"
    assert serve_args(tmp_path, "model: /from-file\n", "--model", "/flag").model_flag == "/flag"


@pytest.mark.parametrize("yaml_text, words", [
    ("- a\n- b\n", "must hold a mapping"),
    ("max-num-seqs: [1\n", "is not YAML"),
    ("trust-remote-code: 1\n", "is a switch; give it true or false"),
    ("no-such-flag: 3\n", "unrecognized arguments: --no-such-flag"),
    ("quantization: awq\n", "invalid choice: 'awq'"),   # refused as on the command line
])
def test_a_file_that_cannot_be_read_as_flags_stops_serve_saying_why(monkeypatch, capsys, tmp_path, yaml_text, words):
    path = tmp_path / "config.yaml"
    path.write_text(yaml_text)
    assert words in serve_refusal(monkeypatch, capsys, "--config", str(path))


def test_a_missing_file_or_a_second_config_stops_serve(monkeypatch, capsys, tmp_path):
    assert "No such file" in serve_refusal(monkeypatch, capsys, "--config", str(tmp_path / "none.yaml"))
    path = tmp_path / "config.yaml"
    path.write_text("port: 1\n")
    assert "more than once" in serve_refusal(monkeypatch, capsys, f"--config={path}", "--config", str(path))


def test_a_server_started_from_a_config_file_serves_with_its_flags(server_model, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("served-model-name: [from-file, alias]\nmax_logprobs: 25\nresponse-role: file-role\n")
    with ServerProcess(server_model, tmp_path, "--config", str(config), "--response-role", "cli-role",
                       served_as=None) as server:
        client = openai_client(server.url)
        assert [m.id for m in client.models.list().data] == ["from-file", "alias"]
        done = client.completions.create(model="alias", prompt="Once", max_tokens=2, logprobs=25)
        assert [len(top) for top in done.choices[0].logprobs.top_logprobs] == [25, 25]
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="alias", prompt="Once", max_tokens=2, logprobs=26)
        chat = client.chat.completions.create(model="from-file", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2)
        assert chat.choices[0].message.role == "cli-role"
