"""Request bodies of the OpenAI API (and vLLM's extensions), validated strictly.

Strict mode refuses "5" for an integer and true for a number; unknown fields are refused as
the OpenAI API refuses them. JSON null in an optional field means "the default", as the OpenAI
API reads it (its client sends null whenever a caller passes None). Ranges follow the OpenAI
API; vLLM's extra fields (top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids, allowed_token_ids, truncate_prompt_tokens, stream_options.continuous_usage_stats,
the structured-output fields, cache_salt, request_id, return_token_ids, prompt_logprobs) are accepted.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, FailFast, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from nanoserve.engine.validation import RequestRefused, check_priority, tokens_kept, truncated
from nanoserve.sampling_params import (MAX_CACHE_SALT_CHARS, MAX_INT, MIN_REPETITION_PENALTY, SEED_RANGE,
                                       SamplingParams)
from nanoserve.server.errors import APIError

MAX_N = 128
MAX_DOCUMENTS = 1024   # their text counts toward the prompt's size limit like any message's
# a conversation's messages (and /v1/responses' input items), a message's content parts or tool
# calls, a request's tools and prompts: each item costs ~5-40 us to validate, translate and render,
# and 200,000 input items took 2 s of the server's time before a 400 (120,000 calls: 5 s). Agents
# replaying long sessions send hundreds to a few thousand; OpenAI's API takes 128 tools and 128
# calls a message
MAX_MESSAGES = 1 << 14
MAX_CONTENT_PARTS = 1 << 14
MAX_TOOL_CALLS_PER_MESSAGE = 1 << 14   # /v1/responses' consecutive function_call items are one message's calls
MAX_TOOLS = 1 << 14
# prompts of one /v1/completions request, read before --max-seqs-per-request (256 by default) is
# checked: that flag may not usefully go past this
MAX_PROMPTS = 1 << 14
# more entries than most vocabularies have tokens; each is parsed on the event loop (~0.5 us)
MAX_LOGIT_BIAS = 1 << 17
# as many ids as the largest vocabularies have tokens (Gemma's 262,144); the engine then refuses
# more than the served model's own vocabulary
MAX_ALLOWED_TOKEN_IDS = 1 << 18


class _FirstError(FailFast):
    __hash__ = object.__hash__   # typing hashes the members of a union; FailFast cannot be hashed


# a list or object of a request stops validating at its first bad item: a million bad items made
# a million errors, and reading them held the event loop (every stream) for 1.3 s, for a 400 naming one
FIRST_ERROR = _FirstError()
T = TypeVar("T")
Items = Annotated[list[T], FIRST_ERROR]
# OpenAI's bounds on metadata: 16 pairs, keys of at most 64 characters, string values of at most 512.
# Unbounded, 10 MB of it came back three times in a Responses stream
MetadataValue = Annotated[str, Field(max_length=512)]
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], MetadataValue], Field(max_length=16)]
# OpenAI's bound on safety_identifier; on prompt_cache_key and the older user it states none, so they
# take a metadata value's (MetadataValue). A Responses stream echoes them three times: 10 MB of user
# made a 30 MB stream
SafetyIdentifier = Annotated[str, Field(max_length=64)]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # a required field keeps its null, so that it is refused by name; null in a field this
        # server does not know (e.g. `functions`) asks for nothing, so it is no reason to refuse
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items() if v is not None or (k in fields and fields[k].is_required())}
            unknown = [k for k in data if k not in _keys_of(cls)]
            # the first unknown key refuses the request, and pydantic would report every one: reading
            # 400,000 such errors held the event loop, and every stream, for 1.7 s
            for key in unknown[1:]:
                del data[key]
        return data


@functools.cache
def _keys_of(model: type[BaseModel]) -> frozenset[str]:
    """The keys a request body may give for `model`'s fields (an aliased field's by its alias)."""
    return frozenset(field.alias or name for name, field in model.model_fields.items())


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk, not only the last
    # OpenAI's: random padding in each chunk against reading lengths off the encrypted stream;
    # accepted, none is added (a TLS terminator in front of this server is where it would belong)
    include_obfuscation: bool | None = None


class JSONSchemaFormat(Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # xgrammar always holds the output to the schema, strict or not


class ResponseFormat(Strict):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(Strict):
    """vLLM's `structured_outputs` request field: exactly one of json, regex, choice, grammar, json_object."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: Items[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


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
    logit_bias: Annotated[dict[str, float], FIRST_ERROR] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    allowed_token_ids: Items[int] | None = Field(None, max_length=MAX_ALLOWED_TOKEN_IDS)  # vLLM's: sample only these
    stop: str | Items[str] | None = None
    stop_token_ids: Items[int] | None = None
    bad_words: Items[str] | None = None  # vLLM's: never complete these words (bounded by SamplingParams)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # vLLM's: False joins adjacent special tokens' text
    include_stop_str_in_output: bool = False
    # vLLM's: logprobs name tokens "token_id:N", so tokens of equal or partial text stay apart
    # (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: each choice carries its new tokens' ids ("token_ids"), and the prompt's ids come too
    return_token_ids: bool = False
    # vLLM's: each prompt token's logprob and this many alternatives, in whole responses only
    # (-1, vLLM's "the whole vocabulary", is refused by name; check_logprobs bounds them by --max-logprobs)
    prompt_logprobs: int | None = Field(None, ge=-1, le=MAX_INT)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's: keep only the last k prompt tokens; -1 keeps as many as the context holds (max_model_len)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT)
    # vLLM's: a request's place under --scheduling-policy priority (lower first); first come, first
    # served takes only 0 (the default), as vLLM does
    priority: int = Field(0, ge=-MAX_INT - 1, le=MAX_INT)
    # vLLM's beam search: not offered here, so true is refused by name (checked with priority);
    # length_penalty weighs beams only, so without them it changes nothing, as in vLLM
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-100.0, le=100.0)
    # vLLM's: the response's id is "cmpl-" (or "chatcmpl-") and this (bounded in server/response.py)
    request_id: str | None = None
    # vLLM's: the prefix cache shares blocks only between requests of the same salt
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # structured outputs (server/structured.py): OpenAI's field, vLLM's, and vLLM's older ones
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Items[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's bookkeeping: accepted and ignored, none of them changes the output
    user: MetadataValue | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: MetadataValue | None = None
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None   # prefixes stay while blocks allow
    safety_identifier: SafetyIdentifier | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults` (the model's generation_config.json) fill the sampling fields the request leaves out."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given = lambda name, fallback: next(  # noqa: E731 - the request's value, the model's, or ours
            v for v in (getattr(self, name), (defaults or {}).get(name), fallback) if v is not None)
        # generation_config's max_new_tokens caps the request's own, as vLLM's get_max_tokens takes the least
        cap = (defaults or {}).get("max_tokens")
        max_tokens = cap if max_tokens is None else max_tokens if cap is None else min(max_tokens, cap)
        return SamplingParams(
            n=self.n, temperature=given("temperature", 1.0), top_p=given("top_p", 1.0),
            top_k=given("top_k", -1) or -1,  # 0 and -1 both mean "off", as in vLLM
            min_p=given("min_p", 0.0), seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=given("repetition_penalty", 1.0), logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), bad_words=list(self.bad_words or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens, cache_salt=self.cache_salt)

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            # ASCII digits only ("²".isdigit() is True), and few of them: int() of 5000 digits raises
            if not key.isascii() or not key.isdigit():
                raise APIError(f"Invalid key in 'logit_bias': {key[:20]!r} is not a token id", param="logit_bias")
            digits = key.lstrip("0") or "0"   # "007" is token 7
            if len(digits) > len(str(MAX_INT)) or int(digits) > MAX_INT:
                raise APIError(f"Token id {key[:20]} in 'logit_bias' is out of range", param="logit_bias")
            bias[int(digits)] = value
        return bias

    def check_priority(self, policy: str) -> None:
        """Scheduling and search settings this server may not offer: a priority the scheduling policy
        ignores, and beam search."""
        try:
            check_priority(self.priority, policy)
        except RequestRefused as exc:
            raise APIError(str(exc), param=exc.param, code=exc.code) from None
        if self.use_beam_search:
            raise APIError("Beam search is not offered by this server: leave use_beam_search false (n and "
                           "best_of give several sampled choices)", param="use_beam_search",
                           code="unsupported_parameter")

    def check_stream_options(self) -> None:
        # options of a stream; an empty object (or nulls) asks for nothing, so it is taken, as vLLM takes it
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")

    def check_logprobs(self, cap: int) -> None:
        """Alternatives past `cap` (--max-logprobs) are refused, as vLLM refuses them, and so is
        prompt_logprobs -1 (vLLM's "the whole vocabulary")."""
        if self.prompt_logprobs == -1:
            raise APIError(f"prompt_logprobs -1 asks for the whole vocabulary at every prompt token; this server "
                           f"returns at most {cap} alternatives (--max-logprobs)", param="prompt_logprobs")
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            asked = getattr(self, name, None)
            if type(asked) is int and asked > cap:   # not chat's logprobs, a bool
                raise APIError(f"{name} asks for {asked} alternatives; this server returns at most {cap} "
                               "(--max-logprobs)", param=name)
        if self.prompt_logprobs and self.stream:   # as vLLM answers: its streams never carry them
            raise APIError("prompt_logprobs are not available when stream is true; ask without streaming",
                           param="prompt_logprobs")

    @property
    def returns_prompt_logprobs(self) -> bool:
        """A whole response carries prompt_logprobs when asked; a stream may ask for 0 and gets none, as in vLLM."""
        return self.prompt_logprobs is not None and not self.stream

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def force_usage(self) -> None:
        """A stream ends with its usage whatever the request asked (vLLM's --enable-force-include-usage)."""
        if self.stream and not self.include_usage:
            self.stream_options = (self.stream_options or StreamOptions()).model_copy(update={"include_usage": True})

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_some(cls, k: int | None) -> int | None:
        if k == 0:
            raise ValueError("truncate_prompt_tokens keeps the prompt's last k tokens: at least 1, or -1 for as "
                             "many as the model's context holds")
        return k

    def fit_truncation(self, max_model_len: int) -> None:
        """vLLM's truncate_prompt_tokens -1: the prompt's last max_model_len tokens."""
        self.truncate_prompt_tokens = tokens_kept(self.truncate_prompt_tokens, max_model_len)

    def truncate(self, prompt: list[int]) -> list[int]:
        return truncated(prompt, self.truncate_prompt_tokens)


class CompletionRequest(SamplingFields):
    # token ids first: pydantic takes the first member that matches, and a list of ids is the
    # common case of load generators and harnesses (5x faster to validate than trying str first)
    prompt: (Items[int] | str | Annotated[Items[str], Field(max_length=MAX_PROMPTS)]
             | Annotated[Items[Items[int]], Field(max_length=MAX_PROMPTS)])
    # None: 16, as in the OpenAI API (the endpoint fills it in); 0, with echo: the prompt alone, as vLLM's
    max_tokens: int | None = Field(None, ge=0, le=MAX_INT)
    logprobs: int | None = Field(None, ge=0, le=MAX_INT)   # bounded by check_logprobs
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS and the like around a text prompt

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_kind_of_prompt(cls, value: Any, handler: Any) -> Any:
        """A list that mixes texts, token ids and token-id lists is refused as such: the union's first
        member ("prompt.0: Input should be a valid integer") blamed a valid text. Looked at only
        once the value has failed."""
        try:
            return handler(value)
        except ValidationError:
            if isinstance(value, list) and len({_prompt_item_kind(item) for item in value}) > 1:
                raise PydanticCustomError(
                    "prompt_type", "a prompt is a string, an array of strings, an array of token ids or an array "
                    "of token-id arrays, and this array mixes them") from None
            raise


def _prompt_item_kind(item: Any) -> str:
    return "text" if isinstance(item, str) else "ids" if isinstance(item, list) else type(item).__name__
