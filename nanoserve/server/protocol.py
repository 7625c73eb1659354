"""Request bodies of the OpenAI API (and vLLM's extensions), validated strictly.

Strict mode refuses "5" for an integer and true for a number; unknown fields are refused as
the OpenAI API refuses them. Ranges follow the OpenAI API; vLLM's extra fields (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, truncate_prompt_tokens,
stream_options.continuous_usage_stats) are accepted.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from nanoserve.sampling_params import MAX_INT, MIN_REPETITION_PENALTY, SEED_RANGE, SamplingParams
from nanoserve.server.errors import APIError

MAX_N = 128
MAX_LOGPROBS = 20


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk, not only the last


class SamplingFields(Strict):
    """Fields that completions and chat share; `sampling_params()` turns them into SamplingParams."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT)  # past the vocabulary: all of it
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=2)
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=MAX_INT)  # vLLM's: keep only the last k prompt tokens

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if not self.top_k else self.top_k,  # 0 and -1 both mean "off", as in vLLM
            min_p=self.min_p or 0.0, seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0, logit_bias=self._logit_bias(),
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens)

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            # ASCII digits only ("²".isdigit() is True), and few of them: int() of 5000 digits raises
            if not key.isascii() or not key.isdigit():
                raise APIError(f"Invalid key in 'logit_bias': {key[:20]!r} is not a token id", param="logit_bias")
            if len(key) > len(str(MAX_INT)) or int(key) > MAX_INT:
                raise APIError(f"Token id {key[:20]} in 'logit_bias' is out of range", param="logit_bias")
            if not -100 <= value <= 100:
                raise APIError(f"Invalid value in 'logit_bias' for token {key}: {value} is outside [-100, 100]",
                               param="logit_bias")
            bias[int(key)] = value
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def truncate(self, prompt: list[int]) -> list[int]:
        k = self.truncate_prompt_tokens
        return prompt[-k:] if k is not None else prompt


class CompletionRequest(SamplingFields):
    # token ids first: pydantic takes the first member that matches, and a list of ids is the
    # common case of load generators and harnesses (5x faster to validate than trying str first)
    prompt: list[int] | str | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)  # None: whatever is left of the context
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)  # the OpenAI API's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]
