"""The model's tokenizer and the token ids that end its text, as the engine and the front end load them."""

from __future__ import annotations

import os
import sys

from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """ValueError naming `path` when transformers cannot load it: its OSError (a path that is no
    folder is read as a Hub id) ended serve and generate in a traceback."""
    if path.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(path)):
        # transformers reads it as a Hub id, and refused it for its characters
        raise ValueError(f"Tokenizer folder {path!r} (--tokenizer, else the model folder's own) does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"Tokenizer {path!r} (--tokenizer, else the model folder's own) cannot be loaded: "
                         f"{exc}") from exc
    if len(tokenizer) <= 1:
        # a folder without tokenizer files still loads, as an empty tokenizer: every prompt came out
        # as no tokens, and the server looked healthy while it refused every request
        raise ValueError(f"Tokenizer {path!r} (--tokenizer, else the model folder's own) has no vocabulary: the "
                         "folder holds no tokenizer files (tokenizer.json, or vocab.json and merges.txt)")
    # the context's limit is max_model_len, checked with the request's own error; the tokenizer's copy of
    # it only made transformers log that a prompt "will result in indexing errors" beside that refusal
    tokenizer.model_max_length = sys.maxsize
    return tokenizer


def eos_token_ids(model: str, tokenizer: PreTrainedTokenizerBase,
                  hf_config: PretrainedConfig | None = None) -> set[int]:
    """generation_config.json's eos_token_id (one or a list), else config.json's, and the tokenizer's own."""
    ids: set[int] = set()
    try:
        found = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:  # no generation_config.json: the model's config says it, as vLLM reads it then
        found = getattr(hf_config, "eos_token_id", None)
    ids.update(found if isinstance(found, list) else [found] if found is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
