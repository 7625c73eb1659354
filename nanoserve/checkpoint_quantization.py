"""What a checkpoint's `quantization_config` says about its weights, and whether they can be read.

FP8 checkpoints (Qwen's and DeepSeek's `quant_method: fp8` with 128 x 128 blocks, per-tensor fp8
from vLLM's tools, and compressed-tensors' float-quantized 8-bit weights) hold each linear
weight as e4m3 with its scales beside it. They are read here by widening every such weight to the
model's dtype at load (weight x its scale, in float32), so such a checkpoint serves the model it
quantized, at the memory and speed of unquantized weights. Any other quantization (AWQ, GPTQ,
bitsandbytes, int4/int8 compressed-tensors) is refused by name: its tensors would not load, or
would load as numbers that mean something else.

Nothing here imports torch: `serve` checks the config before anything heavy loads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

# the scale tensors beside a weight, by checkpoint suffix; input scales (static activation
# quantization) are left unread: activations stay in the model's dtype here
WEIGHT_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
FP8, COMPRESSED_TENSORS = "fp8", "compressed-tensors"
READ_METHODS = (FP8, COMPRESSED_TENSORS)   # the quant_method values whose weights are read here
UNREAD_SUFFIXES = (".input_scale",)


@dataclass(frozen=True)
class Fp8Weights:
    """How a checkpoint's fp8 weights are scaled: `block` (rows, columns) for block-wise scales,
    None where each scale covers a whole tensor or an output row (told by the scale's shape)."""
    method: str
    block: tuple[int, int] | None


def fp8_weights(hf_config: Any) -> Fp8Weights | None:
    """The fp8 weights of a checkpoint, None where its weights are not quantized; ValueError for a
    quantization whose weights cannot be read here."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    method = str(quant.get("quant_method", "<none>"))
    if method == FP8:
        return Fp8Weights(method, _block(quant.get("weight_block_size"), method))
    if method == COMPRESSED_TENSORS:
        return Fp8Weights(method, _compressed_tensors_block(quant))
    raise ValueError(f"The checkpoint's weights are quantized with {method!r}, which is not read here: serve its "
                     "unquantized (bf16/fp16) weights, or an fp8 checkpoint (quant_method 'fp8' or "
                     "compressed-tensors float 8-bit)")


def _block(value: Any, method: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"The checkpoint's {method} weight block size must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _compressed_tensors_block(quant: dict) -> tuple[int, int] | None:
    """compressed-tensors: every group's weights must be 8-bit floats; their block, if any."""
    fmt = quant.get("format")
    groups = quant.get("config_groups") or {}
    if fmt != "float-quantized" or not groups:
        raise ValueError(f"The checkpoint's compressed-tensors format {fmt!r} is not read here: only "
                         "'float-quantized' (fp8) weights are")
    blocks = set()
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(f"The checkpoint's compressed-tensors group {name!r} quantizes weights to "
                             f"{weights.get('num_bits')}-bit {weights.get('type')}; only 8-bit float weights are read")
        blocks.add(_block(weights.get("block_structure"), "compressed-tensors"))
    if len(blocks) > 1:
        raise ValueError(f"The checkpoint's compressed-tensors groups use different weight blocks {sorted(map(str, blocks))}")
    return blocks.pop()


def check_quantization(weights: Fp8Weights | None, asked: str | None) -> None:
    """vLLM's `quantization` (`--quantization`) names the checkpoint's own method here (weights are
    never quantized at load): refused, with the reason, where the checkpoint says otherwise."""
    if asked is None or (weights is not None and weights.method == asked):
        return
    found = f"quantized with {weights.method!r}" if weights is not None else "not quantized"
    raise ValueError(f"quantization {asked!r} was asked for, but the checkpoint is {found}, and weights are not "
                     "quantized at load here; leave it out (an fp8 checkpoint is read as it is; kv_cache_dtype fp8 "
                     "stores the KV cache in fp8)")


def check_quantization_flag(folder: str, flag: str | None) -> None:
    """check_quantization from the folder's config.json, before anything heavy loads; an
    unreadable quantization is refused either way."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            quant = json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        quant = None   # the config's own reader names what is wrong with it, later
    check_quantization(fp8_weights(SimpleNamespace(quantization_config=quant)), flag)
