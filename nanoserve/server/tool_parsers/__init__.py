"""Tool-call parsers by the name `--tool-call-parser` takes (vLLM's names)."""

from __future__ import annotations

from nanoserve.server.tool_parsers.base import Parsed, PartialCall, ToolParser
from nanoserve.server.tool_parsers.hermes import HermesToolParser
from nanoserve.server.tool_parsers.llama3_json import Llama3JsonToolParser
from nanoserve.server.tool_parsers.mistral import MistralToolParser
from nanoserve.server.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)}

__all__ = ["TOOL_PARSERS", "Parsed", "PartialCall", "ToolParser"]
