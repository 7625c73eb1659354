"""An engine config for random weights of the architecture a bare config.json describes."""

from __future__ import annotations

import json
import os

from transformers import AutoConfig

from nanoserve import DEFAULT_MODEL, EngineConfig


def config_from_file(path: str, **kwargs) -> EngineConfig:
    """An EngineConfig for random weights of the architecture described in a config.json file.

    The bundled model's tokenizer stands in: benchmarks feed token ids and read token ids.
    """
    with open(path) as f:
        values = json.load(f)
    hf_config = AutoConfig.for_model(values.pop("model_type"), **values)
    return EngineConfig(model=os.path.dirname(os.path.abspath(path)), tokenizer=DEFAULT_MODEL,
                        hf_config=hf_config, load_format="dummy", **kwargs)
