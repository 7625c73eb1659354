"""A CPU KV cache is resident from the start, and the tokenizer leaves the context's limit to the engine."""

from __future__ import annotations

import logging

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.tokenizer import load_tokenizer
from nanoserve.runner.kv_cache import KVCache, block_bytes


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_a_cpu_kv_cache_is_resident_once_made():
    # left to first use, the process grew by the cache's size over the first thousands of requests
    config = EngineConfig(device="cpu", dtype="bfloat16")
    blocks = (256 << 20) // block_bytes(config)
    before = _rss_bytes()
    cache = KVCache(config, blocks, torch.device("cpu"))
    assert _rss_bytes() - before > 0.9 * cache.tensor.numel() * cache.tensor.element_size()
    assert not cache.tensor[:, :, -1].any()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_prompt_past_the_tokenizers_own_limit_logs_no_indexing_warning():
    # beside the request's own refusal (max_model_len), transformers said the prompt "will result in
    # indexing errors"; its logger does not propagate, so a handler of its own listens
    tokenizer = load_tokenizer(EngineConfig(device="cpu").tokenizer)
    seen = _Lines()
    logger = logging.getLogger("transformers")
    logger.addHandler(seen)
    try:
        ids = tokenizer.encode("word " * 3000)
        tokenizer.model_max_length = 2048   # the folder's own value: the warning this handler does see
        tokenizer.encode("word " * 3000)
    finally:
        logger.removeHandler(seen)
    assert len(ids) > 2048
    assert len(seen.lines) == 1 and "indexing errors" in seen.lines[0], seen.lines
