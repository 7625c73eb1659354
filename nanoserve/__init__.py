"""nanoserve: a lean OpenAI-compatible inference server for decoder-only LLMs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanoserve.defaults import DEFAULT_MODEL

if TYPE_CHECKING:
    from nanoserve.config import EngineConfig
    from nanoserve.engine.llm import LLM, RequestOutput
    from nanoserve.engine.vllm_logprobs import Logprob
    from nanoserve.sampling_params import SamplingParams
    from nanoserve.structured_outputs_params import StructuredOutputsParams

__all__ = ["DEFAULT_MODEL", "EngineConfig", "LLM", "Logprob", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
__version__ = "0.1.0"

# imported on first use, so that `nanoserve --help` and `python -m nanoserve` need no torch
_LAZY = {"EngineConfig": "nanoserve.config", "LLM": "nanoserve.engine.llm", "RequestOutput": "nanoserve.engine.llm",
         "Logprob": "nanoserve.engine.vllm_logprobs", "SamplingParams": "nanoserve.sampling_params",
         "StructuredOutputsParams": "nanoserve.structured_outputs_params"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
