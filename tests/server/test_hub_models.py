"""A model given as a Hugging Face Hub repository id (`nanoserve serve Qwen/Qwen3-0.6B`, as vLLM
takes it): fetched into the Hub's cache, served under that id, served again offline from the
cache, and refused with what to change when it cannot be fetched. The Hub is tests/server/fake_hub.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.server.conftest import REPO, ServerProcess, openai_client
from tests.runner.test_weight_files import sharded_copy
from tests.server.fake_hub import FakeHub, folder_files

REPO_ID = "acme/tiny-qwen3"


@pytest.fixture(scope="module")
def hub(server_model, tmp_path_factory):
    model = folder_files(server_model)
    # copies of the weights the server does not read: never fetched
    decoys = {"pytorch_model.bin": b"\0" * 4096, "model.gguf": b"\0" * 4096, "README.md": b"# tiny"}
    sharded = folder_files(sharded_copy(tmp_path_factory.mktemp("hub") / "sharded"))
    repos = {REPO_ID: {**model, **decoys}, "acme/sharded": sharded,
             "acme/gated": model,
             "acme/bin-only": {"config.json": model["config.json"], "pytorch_model.bin": b"\0" * 64},
             # indexes no checkpoint writes: none of them may end in a traceback, or send the loader
             # to a file outside the snapshot
             "acme/index-without-map": {**model, "model.safetensors.index.json": b'{"metadata": {}}'},
             "acme/index-not-json": {**model, "model.safetensors.index.json": b"{weight_map"},
             "acme/index-outside": {**model, "model.safetensors.index.json":
                                    b'{"weight_map": {"lm_head.weight": "../../../../outside.safetensors"}}'}}
    with FakeHub(repos, gated=("acme/gated",)) as running:
        yield running


def nanoserve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE"):
        if name not in env:
            full_env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "nanoserve.cli", *args], capture_output=True, text=True,
                          env=full_env, cwd=REPO, timeout=300)


def test_a_hub_repository_is_fetched_served_under_its_id_and_served_again_offline(hub, server, tmp_path):
    cache = tmp_path / "hub-cache"
    prompt = dict(prompt="The weather today is", max_tokens=8, temperature=0.0)
    expected = openai_client(server.url).completions.create(model="tiny", **prompt).choices[0].text
    with ServerProcess(REPO_ID, tmp_path, "--download-dir", str(cache), served_as=None,
                       env={"HF_ENDPOINT": hub.url}) as served:
        client = openai_client(served.url)
        assert [m.id for m in client.models.list()] == [REPO_ID]   # vLLM's default name: the id as given
        assert client.completions.create(model=REPO_ID, **prompt).choices[0].text == expected
    assert hub.downloaded() == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                "tokenizer_config.json"}
    assert (cache / "models--acme--tiny-qwen3" / "snapshots").is_dir()

    hub.requests.clear()
    offline = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "1"}
    with ServerProcess(REPO_ID, tmp_path, "--download-dir", str(cache), env=offline) as again:
        assert openai_client(again.url).completions.create(model="tiny", **prompt).choices[0].text == expected
    # the offline CLI path (EngineConfig resolves the id itself) reads the same snapshot
    done = nanoserve("generate", "The weather today is", "--model", REPO_ID, "--download-dir", str(cache),
                     "--max-tokens", "8", "--device", "cpu", env=offline)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n") == expected
    assert hub.requests == [], "offline, the Hub was still asked"


def test_a_sharded_repository_fetches_the_files_its_index_names_and_no_other_copy(hub, server, tmp_path):
    expected = openai_client(server.url).completions.create(model="tiny", prompt="One, two,", max_tokens=6,
                                                             temperature=0.0).choices[0].text
    hub.requests.clear()
    done = nanoserve("generate", "One, two,", "--model", "acme/sharded", "--download-dir", str(tmp_path / "cache"),
                     "--max-tokens", "6", "--device", "cpu", env={"HF_ENDPOINT": hub.url})
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n") == expected
    assert "model-00001-of-00001.safetensors" in hub.downloaded()
    assert "consolidated.safetensors" not in hub.downloaded()


@pytest.mark.parametrize("model, flags, env, refusal", [
    ("acme/missing", (), {}, "no such repository, or it is private"),
    ("acme/gated", (), {}, "the repository is gated. Accept its terms"),
    ("acme/bin-only", (), {}, "has no *.safetensors weights"),
    (REPO_ID, ("--revision", "v9"), {}, "it has no revision 'v9' (--revision)"),
    (REPO_ID, (), {"HF_HUB_OFFLINE": "1"}, "it is not in the Hub's cache"),
    ("/no/such/folder", (), {}, "Model folder '/no/such/folder' does not exist"),
    ("./no-such-folder", (), {}, "Model folder './no-such-folder' does not exist"),
    ("README.md", (), {}, "Model folder 'README.md' is a file, not a model folder"),
    ("acme/index-without-map", (), {}, "model.safetensors.index.json is not a safetensors index"),
    ("acme/index-not-json", (), {}, "model.safetensors.index.json is not a safetensors index"),
    ("acme/index-outside", (), {}, "model.safetensors.index.json is not a safetensors index"),
])
def test_a_model_that_cannot_be_fetched_is_refused_before_anything_loads(hub, tmp_path, model, flags, env, refusal):
    done = nanoserve("serve", model, "--device", "cpu", "--download-dir", str(tmp_path / "empty-cache"), *flags,
                     env={"HF_ENDPOINT": hub.url, **env})
    assert done.returncode == 2, done.stderr
    assert refusal in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "Loading weights" not in done.stderr
    if model.startswith(("/", ".")) or os.path.exists(os.path.join(REPO, model)):   # a path: the Hub is not asked
        assert "Fetching" not in done.stderr, done.stderr


def test_a_revision_given_with_a_local_folder_is_said_to_be_ignored(caplog):
    from nanoserve.config import DEFAULT_MODEL
    from nanoserve.model_source import resolve_model

    with caplog.at_level("WARNING", logger="nanoserve.model_source"):
        assert resolve_model(DEFAULT_MODEL, revision="v2") == DEFAULT_MODEL
    assert "--revision v2 is ignored" in caplog.text
