"""Which *.safetensors files hold a model's weights: those its index names, when it has one."""

from __future__ import annotations

import json
import shutil

from safetensors import safe_open

from nanoserve import LLM, SamplingParams
from nanoserve.config import DEFAULT_MODEL
from nanoserve.model_source import weight_files


def sharded_copy(folder, with_decoy: bool = True):
    """The bundled model as a sharded checkpoint (one shard and its index), with a file of the
    same suffix beside it that is not a checkpoint at all (as consolidated.safetensors stands
    beside Mistral's shards)."""
    shutil.copytree(DEFAULT_MODEL, folder)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    with safe_open(str(folder / "model-00001-of-00001.safetensors"), framework="pt") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": {name: "model-00001-of-00001.safetensors" for name in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if with_decoy:
        (folder / "consolidated.safetensors").write_bytes(b"not a checkpoint")
    return folder


def test_an_index_names_the_weight_files_and_a_copy_beside_them_is_not_read(tmp_path):
    folder = sharded_copy(tmp_path / "sharded")
    assert weight_files(str(folder)) == ["model-00001-of-00001.safetensors"]
    (folder / "model.safetensors.index.json").unlink()
    assert weight_files(str(folder)) == ["consolidated.safetensors", "model-00001-of-00001.safetensors"]


def test_a_sharded_model_with_a_stray_safetensors_file_loads_and_generates_as_the_original(tmp_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = ["The weather today is", "One, two,"]
    expected = [o.token_ids for o in LLM(device="cpu").generate(prompts, greedy, use_tqdm=False)]
    sharded = LLM(str(sharded_copy(tmp_path / "sharded")), device="cpu")
    assert [o.token_ids for o in sharded.generate(prompts, greedy, use_tqdm=False)] == expected
