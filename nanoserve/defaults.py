"""Names the CLI needs before it knows whether it will load a model: nothing here imports torch.

`nanoserve --help` must answer in well under a second, and torch plus transformers take seconds.
"""

from __future__ import annotations

import os

DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "assets", "tiny-qwen3")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
KV_CACHE_DTYPES = ("auto", "fp8")  # vLLM's names: auto = the model's dtype, fp8 = e4m3
