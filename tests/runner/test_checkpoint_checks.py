"""A checkpoint that cannot be the model is refused by name: a missing piece of a packed weight,
a shard its index names but the folder lacks, a tensor of the wrong shape."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve import LLM
from nanoserve.config import DEFAULT_MODEL


def copy_without(folder, drop: set[str] = frozenset(), reshape: dict[str, tuple[int, ...]] | None = None):
    """The bundled model with some tensors left out or cut to another shape."""
    shutil.copytree(DEFAULT_MODEL, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors = {name: t for name, t in tensors.items() if name not in drop}
    for name, shape in (reshape or {}).items():
        tensors[name] = torch.zeros(shape, dtype=tensors[name].dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("piece", ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",
                                   "model.layers.0.self_attn.q_proj.weight"])
def test_a_missing_piece_of_a_packed_weight_is_refused_by_its_name(tmp_path, piece):
    # the packed qkv / gate-up parameter counted as loaded once any one piece came: the missing
    # rows kept their random initialization and the output changed with the seed
    with pytest.raises(ValueError, match=f"lacks 1 tensors.*{piece.replace('.', '[.]')}"):
        LLM(copy_without(tmp_path / "model", {piece}), device="cpu")


def test_a_shard_the_index_names_but_the_folder_lacks_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, folder)
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors",
                                            "model.embed_tokens.weight": "model.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names 1 files that are not there.*model-00002-of-00002"):
        LLM(str(folder), device="cpu")


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match=f"{name.replace('.', '[.]')}' has 3 rows"):
        LLM(copy_without(tmp_path / "model", reshape={name: (3, 64)}), device="cpu")


@pytest.mark.parametrize("keep", [0.5, 0.0001])
def test_a_weights_file_cut_short_is_refused_by_its_path_without_a_traceback(tmp_path, keep):
    # a download cut off mid-file (or one that is not safetensors at all) raised the reader's own
    # SafetensorError, "header too large", with neither the file's name nor what to do
    folder = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:max(1, int(len(data) * keep))])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a whole safetensors file .*incomplete"):
        LLM(str(folder), device="cpu")
