"""Fills a model's parameters from the *.safetensors files of a Hugging Face folder."""

from __future__ import annotations

import logging
import os

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from nanoserve.checkpoint_quantization import UNREAD_SUFFIXES, WEIGHT_SCALE_SUFFIXES, Fp8Weights, fp8_weights
from nanoserve.model_source import weight_files

logger = logging.getLogger(__name__)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# checkpoint names of an fp8 KV cache's per-layer scales, as vLLM reads them (ModelOpt puts them
# under k_proj / v_proj; kv_scale is the older single scale for both) -> the Attention attributes
KV_SCALE_SUFFIXES = {
    ".self_attn.k_scale": ("k_scale",), ".self_attn.v_scale": ("v_scale",),
    ".self_attn.k_proj.k_scale": ("k_scale",), ".self_attn.v_proj.v_scale": ("v_scale",),
    ".self_attn.kv_scale": ("k_scale", "v_scale"),
}


def _plain_copy(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def _load_kv_scale(model: nn.Module, name: str, f) -> bool:
    """Set the attention layer's k_scale / v_scale when `name` is one; False when it is not."""
    suffix = next((s for s in KV_SCALE_SUFFIXES if name.endswith(s)), None)
    if suffix is None:
        return False
    try:
        layer = model.get_submodule(name[: -len(suffix)] + ".self_attn")
    except AttributeError:
        raise ValueError(f"Checkpoint tensor {name!r} has no place in {type(model).__name__}") from None
    value = f.get_tensor(name).float()
    if value.numel() != 1 or not (value.isfinite().all() and value.item() > 0):
        raise ValueError(f"Checkpoint tensor {name!r} must be one positive scale per layer, got "
                         f"{value.numel()} values ({value.flatten()[:4].tolist()}...)")
    for attr in KV_SCALE_SUFFIXES[suffix]:
        setattr(layer, attr, value.item())
    return True


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """An fp8 weight [out, in] times its scale, in float32: one scale for the tensor, one an output
    row ([out] or [out, 1]), or one a (rows x columns) block ([ceil(out / rows), ceil(in / cols)],
    the last blocks cut at the edges)."""
    w, s = weight.float(), scale.float()
    out, cols = w.shape
    if block is not None and s.dim() == 2 and s.shape == (-(-out // block[0]), -(-cols // block[1])):
        return w * s.repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :cols]
    if s.numel() == 1:
        return w * s.reshape(())
    if s.shape in ((out,), (out, 1)):
        return w * s.reshape(out, 1)
    raise ValueError(f"has scales of shape {tuple(s.shape)}, which fit neither a tensor, its {out} rows nor "
                     f"blocks of {block} over its shape {tuple(w.shape)}")


def _weight_scales(files: list[str]) -> dict[str, torch.Tensor]:
    """Every fp8 weight's scale tensor, by the weight's name (a weight and its scale may lie in two shards)."""
    scales = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                suffix = next((s for s in WEIGHT_SCALE_SUFFIXES if name.endswith(s)), None)
                if suffix is not None:
                    scales[name[: -len(suffix)] + ".weight"] = f.get_tensor(name)
    return scales


def _read_tensor(f, name: str, fp8: Fp8Weights | None, scales: dict[str, torch.Tensor]) -> torch.Tensor:
    """The checkpoint tensor as the model holds it: an fp8 weight widened by its scale."""
    tensor = f.get_tensor(name)
    if tensor.dtype not in FP8_DTYPES:
        return tensor
    if fp8 is None:
        raise ValueError(f"is {tensor.dtype}, but the config has no quantization_config to scale it by")
    if name not in scales:
        raise ValueError(f"is {tensor.dtype} with no {' or '.join(WEIGHT_SCALE_SUFFIXES)} beside it")
    if tensor.dim() != 2:
        raise ValueError(f"is an {tensor.dtype} tensor of {tensor.dim()} dimensions; fp8 weights are matrices")
    return dequantize_fp8(tensor, scales[name], fp8.block)


def load_weights(model: nn.Module, folder: str, packed_modules: dict[str, tuple[str, str]],
                 show_progress: bool = False) -> None:
    """Copy every checkpoint tensor into its parameter; q/k/v and gate/up land in packed weights,
    KV-cache scales on their attention layer."""
    files = [os.path.join(folder, name) for name in weight_files(folder)]
    if not files:
        raise ValueError(f"No *.safetensors files in {folder!r}")
    absent = [os.path.basename(path) for path in files if not os.path.isfile(path)]
    if absent:
        raise ValueError(f"The weight index in {folder!r} names {len(absent)} files that are not there, e.g. "
                         f"{absent[:3]}: the download may be incomplete")
    params = dict(model.named_parameters(remove_duplicate=False))
    fp8 = fp8_weights(model.config)
    scales = _weight_scales(files) if fp8 is not None else {}
    if fp8 is not None:
        logger.info("The checkpoint's weights are fp8 (%s%s): widened to %s at load, so they take the memory of "
                    "unquantized weights", fp8.method, f", blocks of {fp8.block[0]}x{fp8.block[1]}" if fp8.block else "",
                    next(iter(params.values())).dtype)
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded_names: set[str] = set()
    loaded_shards: set[tuple[str, object]] = set()   # (packed parameter, shard): each must come
    for path in tqdm(files, desc="Loading weights", disable=not show_progress):
        try:
            opened = safe_open(path, framework="pt")
        except SafetensorError as exc:   # a cut download, or not safetensors at all: its header does not fit
            raise ValueError(f"{path} is not a whole safetensors file ({exc}): the download may be incomplete "
                             "or the file corrupt") from None
        with opened as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                    continue
                if _load_kv_scale(model, name, f):
                    continue
                if fp8 is not None and name.endswith(WEIGHT_SCALE_SUFFIXES + UNREAD_SUFFIXES):
                    continue   # a scale is read with its weight; activations are not quantized here
                target, shard = name, None
                for fragment, (packed, shard_name) in packed_modules.items():
                    if f".{fragment}." in name:
                        target, shard = name.replace(f".{fragment}.", f".{packed}."), shard_name
                        break
                if target not in params:
                    raise ValueError(f"Checkpoint tensor {name!r} has no place in {type(model).__name__}")
                param = params[target]
                loader = getattr(param, "weight_loader", None)
                try:
                    tensor = _read_tensor(f, name, fp8, scales)
                    if shard is not None:
                        loader(param, tensor, shard)
                        loaded_shards.add((target, shard))
                    elif loader is not None:  # a tensor-parallel slice
                        loader(param, tensor)
                    else:
                        _plain_copy(param, tensor)
                except ValueError as exc:
                    raise ValueError(f"Checkpoint tensor {name!r} {exc}") from None
                loaded_names.add(target)
    missing = [n for n in params if n not in loaded_names and not (tied and n == "lm_head.weight")]
    # a packed parameter is filled by pieces (q, k and v): one piece must not pass for all of them
    missing += [name.replace(f".{packed}.", f".{fragment}.") for name in params if name in loaded_names
                for fragment, (packed, shard) in packed_modules.items()
                if f".{packed}." in name and (name, shard) not in loaded_shards]
    if missing:
        raise ValueError(f"Checkpoint in {folder!r} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of a realistic scale, for benchmarks of configs without a checkpoint."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.data.normal_(0.0, 0.02, generator=generators[param.device])
