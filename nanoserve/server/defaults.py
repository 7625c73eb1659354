"""Default sampling settings from the model folder's generation_config.json, as vLLM's
`--generation-config auto` reads them; `vllm` ignores the file (the defaults are then ours), and
a folder reads that folder's file instead."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key -> request field it supplies when the request leaves it out
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty"}


def check_generation_config(mode: str) -> None:
    """ValueError unless `mode` is one that --generation-config takes."""
    if mode not in ("auto", "vllm") and not os.path.isdir(mode):
        raise ValueError(f"--generation-config must be 'auto', 'vllm' or a folder holding generation_config.json, "
                         f"got {mode!r}")


def sampling_defaults(model_folder: str, mode: str = "auto") -> dict[str, Any]:
    """The request fields the model's generation_config.json sets; empty for mode 'vllm' or no file."""
    check_generation_config(mode)
    path = os.path.join(model_folder if mode == "auto" else mode, "generation_config.json")
    if mode == "vllm" or not os.path.isfile(path):
        return {}
    with open(path) as f:
        found = json.load(f)
    defaults = {field: found[key] for key, field in SAMPLING_KEYS.items() if found.get(key) is not None}
    if defaults:
        logger.info("Default sampling settings from %s: %s (--generation-config vllm ignores them)", path, defaults)
    return defaults
