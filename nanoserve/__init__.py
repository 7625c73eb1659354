"""nanoserve: a lean OpenAI-compatible inference server for decoder-only LLMs."""

from nanoserve.config import DEFAULT_MODEL, EngineConfig
from nanoserve.engine.llm import LLM, RequestOutput
from nanoserve.sampling_params import SamplingParams

__all__ = ["DEFAULT_MODEL", "EngineConfig", "LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
