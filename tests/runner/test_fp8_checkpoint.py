"""FP8 checkpoints (quant_method fp8 with weight blocks, compressed-tensors per-channel fp8) load as
the model they quantize: every weight widened by its own scales, answering as transformers does
over the same widened weights; other quantizations are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve import LLM
from nanoserve.checkpoint_quantization import check_quantization_flag
from nanoserve.runner.loader import dequantize_fp8
from tests.conftest import greedy, hf_greedy, random_prompts

E4M3_MAX = 448.0
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = (32, 48)   # rows x columns; 48 does not divide the 64- and 128-wide inputs, so edge blocks are cut
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
CHANNEL_CONFIG = {"quant_method": "compressed-tensors", "format": "float-quantized",
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                                    "strategy": "channel"}}}}


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e4m3 values, one float32 scale a block, and the widened weight, block by block."""
    rows, cols = -(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1])
    values = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(rows, cols)
    widened = torch.empty(weight.shape)
    for i in range(rows):
        for j in range(cols):
            where = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scales[i, j] = weight[where].abs().max() / E4M3_MAX
            values[where] = (weight[where] / scales[i, j]).to(torch.float8_e4m3fn)
            widened[where] = values[where].float() * scales[i, j]
    return values, scales, widened


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scales = weight.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    values = (weight / scales).to(torch.float8_e4m3fn)
    return values, scales, torch.stack([values[r].float() * scales[r] for r in range(weight.shape[0])])


def fp8_folders(source: str, root: Path, per_channel: bool) -> tuple[str, str, dict[str, torch.Tensor]]:
    """An fp8 copy of `source` and a plain float32 copy holding the same widened weights (what
    transformers is run on), and those widened weights by name. Each weight's blocks are first
    scaled by factors of 1/4 to 4, so a scale read for the wrong block shows."""
    quantized, reference = root / "fp8", root / "widened"
    for folder in (quantized, reference):
        shutil.copytree(source, folder)
    tensors = load_file(str(Path(source) / "model.safetensors"))
    fp8_tensors, widened_tensors = dict(tensors), dict(tensors)
    gen = torch.Generator().manual_seed(7)
    for name, weight in tensors.items():
        if not name.endswith(".weight") or name.split(".")[-2] not in LINEAR_NAMES:
            continue
        factors = 4.0 ** (torch.rand(-(-weight.shape[0] // BLOCK[0]), -(-weight.shape[1] // BLOCK[1]), generator=gen)
                          * 2 - 1)
        spread = weight * factors.repeat_interleave(BLOCK[0], 0)[:weight.shape[0]].repeat_interleave(
            BLOCK[1], 1)[:, :weight.shape[1]]
        values, scales, widened = quantize_rows(spread) if per_channel else quantize_blocks(spread, BLOCK)
        fp8_tensors[name] = values
        fp8_tensors[name[: -len("weight")] + ("weight_scale" if per_channel else "weight_scale_inv")] = scales
        widened_tensors[name] = widened
    save_file(fp8_tensors, str(quantized / "model.safetensors"))
    save_file(widened_tensors, str(reference / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = CHANNEL_CONFIG if per_channel else FP8_CONFIG
    (quantized / "config.json").write_text(json.dumps(config))
    return str(quantized), str(reference), widened_tensors


@pytest.mark.parametrize("shape, block", [((300, 200), (128, 128)), ((64, 96), (32, 48)), ((5, 7), (2, 3))])
def test_block_scales_widen_each_block_by_its_own_scale(shape, block):
    weight = torch.randn(shape) * 4
    values, scales, want = quantize_blocks(weight, block)
    assert torch.equal(dequantize_fp8(values, scales, block), want)
    rounded = scales.to(torch.bfloat16)   # some checkpoints keep their scales in bf16
    assert torch.equal(dequantize_fp8(values, rounded, block), dequantize_fp8(values, rounded.float(), block))


def test_tensor_and_row_scales_widen_the_whole_weight_or_each_row():
    weight = torch.randn(48, 40)
    values, row_scales, want = quantize_rows(weight)
    assert torch.equal(dequantize_fp8(values, row_scales, None), want)
    assert torch.equal(dequantize_fp8(values, row_scales.flatten(), (128, 128)), want)
    assert torch.equal(dequantize_fp8(values, torch.tensor(0.5), None), values.float() * 0.5)
    with pytest.raises(ValueError, match=r"scales of shape \(3, 2\)"):
        dequantize_fp8(values, torch.ones(3, 2), (128, 128))


@pytest.mark.parametrize("per_channel", [False, True], ids=["fp8-blocks", "compressed-tensors-channel"])
def test_an_fp8_checkpoint_answers_as_transformers_over_its_widened_weights(tmp_path, qwen3_model, per_channel):
    quantized, reference, widened = fp8_folders(qwen3_model, tmp_path, per_channel)
    prompts = random_prompts(2, 384, 10, 30, seed=5)
    with LLM(quantized, device="cpu", max_model_len=128) as llm:
        layer = llm.engine.runner.model.model.layers[1]
        packed = torch.cat([widened[f"model.layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(layer.self_attn.qkv_proj.weight, packed)
        assert torch.equal(layer.mlp.down_proj.weight, widened["model.layers.1.mlp.down_proj.weight"])
        ours = greedy(llm, prompts, 8)
    assert ours == hf_greedy(reference, prompts, 8)
    method, other = ("compressed-tensors", "fp8") if per_channel else ("fp8", "compressed-tensors")
    check_quantization_flag(quantized, method)   # vLLM's --quantization naming the checkpoint's own
    with pytest.raises(ValueError, match=f"quantized with '{method}'.*not quantized at load"):
        check_quantization_flag(quantized, other)
    # vLLM's LLM(quantization=...) alike
    with LLM(quantized, device="cpu", max_model_len=64, quantization=method) as named:
        assert torch.equal(named.engine.runner.model.model.layers[1].mlp.down_proj.weight,
                           widened["model.layers.1.mlp.down_proj.weight"])
    with pytest.raises(ValueError, match=f"quantization '{other}' was asked for"):
        LLM(quantized, device="cpu", max_model_len=64, quantization=other)


@pytest.mark.parametrize("quantization, words", [
    ({"quant_method": "awq", "bits": 4}, "quantized with 'awq', which is not read here"),
    ({"quant_method": "gptq", "bits": 4}, "quantized with 'gptq'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}, "format 'pack-quantized' is not read"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}}}, "4-bit float; only 8-bit float"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "must be two positive integers"),
])
def test_a_quantization_that_cannot_be_read_is_refused_before_loading(tmp_path, qwen3_model, quantization, words):
    folder = tmp_path / "model"
    shutil.copytree(qwen3_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ValueError, match=words):
        LLM(str(folder), device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match=words):
        check_quantization_flag(str(folder), None)


def test_an_fp8_weight_without_its_scale_or_its_config_is_refused_by_name(tmp_path, qwen3_model):
    quantized, _, _ = fp8_folders(qwen3_model, tmp_path, per_channel=False)
    tensors = load_file(str(Path(quantized) / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name[: -len("weight")] + "weight_scale_inv"},
              str(Path(quantized) / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{name.replace('.', '[.]')}' is torch.float8_e4m3fn with no"):
        LLM(quantized, device="cpu", max_model_len=64)
    config = json.loads((Path(quantized) / "config.json").read_text())
    del config["quantization_config"]
    (Path(quantized) / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="float8_e4m3fn, but the config has no quantization_config"):
        LLM(quantized, device="cpu", max_model_len=64)
