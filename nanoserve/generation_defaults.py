"""Default sampling settings from the model folder's generation_config.json, as vLLM's
`--generation-config auto` reads them; `vllm` ignores the file (the defaults are then ours), and
a folder reads that folder's file instead. `--override-generation-config` sets some of them over
whatever the file says, as vLLM's flag does."""

from __future__ import annotations

import json
import os
from typing import Any

from nanoserve.sampling_params import SamplingParams

# generation_config.json key -> request field it supplies when the request leaves it out (max_new_tokens,
# as in vLLM, also caps a request's own max_tokens)
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_generation_config(mode: str) -> None:
    """ValueError unless `mode` is one that --generation-config takes."""
    if mode not in ("auto", "vllm") and not os.path.isdir(mode):
        raise ValueError(f"--generation-config must be 'auto', 'vllm' or a folder holding generation_config.json, "
                         f"got {mode!r}")


def generation_overrides(text: str | None) -> dict[str, Any]:
    """The request fields --override-generation-config's JSON object sets; ValueError naming what is
    wrong with it (its values are checked as a request's would be, so that no request fails for them)."""
    if text is None:
        return {}
    found = _json_object(text, "--override-generation-config", "give one such as '{\"temperature\": 0.6}'")
    unknown = sorted(set(found) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config cannot set {', '.join(unknown)}: it takes "
                         f"{', '.join(SAMPLING_KEYS)}")
    return _checked({SAMPLING_KEYS[key]: value for key, value in found.items()}, "--override-generation-config")


def _json_object(text: str, where: str, fix: str) -> dict[str, Any]:
    try:
        found = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); {fix}") from None
    if not isinstance(found, dict):
        raise ValueError(f"{where} is not a JSON object; {fix}")
    return found


def _checked(fields: dict[str, Any], where: str) -> dict[str, Any]:
    """fields as a request's SamplingParams takes them (20.0 for top_k is 20), or ValueError naming
    `where`: a bad default would otherwise fail every request that leaves the field out."""
    if fields.get("top_k") == 0:
        fields = {**fields, "top_k": -1}   # off, as transformers and a request read 0
    try:
        params = SamplingParams(**fields)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return {name: getattr(params, name) for name in fields}


def sampling_defaults(model_folder: str, mode: str = "auto", overrides: dict[str, Any] | None = None
                      ) -> dict[str, Any]:
    """The request fields the model's generation_config.json sets (none for mode 'vllm' or no
    file), with `overrides` (generation_overrides) over them; ValueError for a value no request
    could take."""
    check_generation_config(mode)
    path = os.path.join(model_folder if mode == "auto" else mode, "generation_config.json")
    defaults: dict[str, Any] = {}
    if mode != "vllm" and os.path.isfile(path):
        with open(path) as f:
            found = _json_object(f.read(), path, "fix it, or pass --generation-config vllm to ignore the file")
        defaults = _checked({field: found[key] for key, field in SAMPLING_KEYS.items() if found.get(key) is not None},
                            f"{path} (--generation-config vllm ignores the file)")
    return {**defaults, **(overrides or {})}
