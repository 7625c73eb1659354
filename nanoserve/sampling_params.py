"""Per-request sampling settings, shared by the engine (stopping) and the runner (sampling)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StructuredOutputsParams:
    """A grammar the output must follow; exactly one of json, json_object, regex, choice, grammar.

    Plain JSON-able fields only: the engine compiles it (and caches by `key`) in its own process.
    """

    json: str | dict[str, Any] | None = None  # a JSON schema (text or object)
    json_object: bool = False                  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None            # exactly one of these strings
    grammar: str | None = None                 # EBNF (GBNF), xgrammar's dialect
    any_whitespace: bool = True                # False: JSON without optional whitespace

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice and grammar; "
                             f"got {given or 'none'}")
        if self.choice is not None and not self.choice:
            raise ValueError("structured outputs 'choice' needs at least one string")

    @property
    def key(self) -> tuple:
        """Equal for specs that compile to the same grammar: the compile cache's key."""
        schema = self.json if not isinstance(self.json, dict) else json.dumps(self.json, sort_keys=True)
        return (schema, self.json_object, self.regex, tuple(self.choice or ()), self.grammar, self.any_whitespace)


@dataclass
class SamplingParams:
    """How one request picks tokens and when it stops.

    temperature 0 means greedy (argmax). top_k -1 and top_p 1.0 and min_p 0.0 disable
    those filters. max_tokens None means "whatever is left of the context".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    # logprob of every prompt token after the first, with this many top alternatives; such a
    # prompt is computed in full (prefix-cache hits would skip the positions that score it)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, no text (saves host time in benchmarks)
    structured_outputs: StructuredOutputsParams | None = None  # the output follows this grammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.structured_outputs, dict):  # e.g. decoded from a message
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
