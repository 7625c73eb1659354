"""An engine config for random weights of the architecture a bare config.json describes."""

from __future__ import annotations

import json
import os
import tempfile

from transformers import AutoConfig

from nanoserve import DEFAULT_MODEL, EngineConfig


def config_from_file(path: str, full_vocab_tokenizer: bool = False, **kwargs) -> EngineConfig:
    """An EngineConfig for random weights of the architecture described in a config.json file.

    The bundled model's tokenizer stands in: benchmarks feed token ids and read token ids. Where
    token strings matter (structured outputs), `full_vocab_tokenizer` writes one that covers the
    whole vocabulary instead (benchmarks/synthetic_tokenizer.py).
    """
    with open(path) as f:
        values = json.load(f)
    hf_config = AutoConfig.for_model(values.pop("model_type"), **values)
    tokenizer = DEFAULT_MODEL
    if full_vocab_tokenizer:
        from nanoserve.benchmarks.synthetic_tokenizer import synthetic_tokenizer

        tokenizer = tempfile.mkdtemp(prefix="nanoserve-tokenizer-")
        synthetic_tokenizer(tokenizer, hf_config.vocab_size)
    return EngineConfig(model=os.path.dirname(os.path.abspath(path)), tokenizer=tokenizer,
                        hf_config=hf_config, load_format="dummy", **kwargs)
