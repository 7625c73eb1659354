"""The one check of a prompt before it is queued, at whichever door it comes in (LLM or AsyncEngine)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from nanoserve.sampling_params import SamplingParams, only_of_type


class RequestRefused(ValueError):
    """A request that cannot be served as asked, with what an OpenAI error says beside the message:
    `param`, the request field to change (None: no one field), and `code`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str, param: str | None = None) -> None:
    """Raise RequestRefused (about `param`) naming the first id outside the vocabulary."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return  # min and max run at C speed: the common case costs microseconds
    bad = next(t for t in token_ids if not 0 <= t < vocab_size)
    raise RequestRefused(f"Token id {bad} in {what} is out of range: the vocabulary has {vocab_size} tokens", param)


def as_token_ids(prompt: Sequence[int]) -> list[int]:
    """A prompt given as token ids, as a list of ints; RequestRefused for anything else in it (2.5 or
    "7" failed deep in the tokenizer, True was taken as id 1)."""
    ids = list(prompt)
    if only_of_type(int, ids):
        return ids
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
    if bad is not None:
        raise RequestRefused(f"A prompt of token ids holds {bad!r:.40}, which is not a token id (an integer)", "prompt")
    return [int(token) for token in ids]   # numpy's integers


def tokens_kept(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens: how many of a prompt's last tokens are kept (-1: max_model_len),
    None for all of them."""
    return max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def truncated(prompt: list[int], keep: int | None) -> list[int]:
    """The prompt's last `keep` tokens (tokens_kept), or the whole prompt for None."""
    return prompt[-keep:] if keep is not None else prompt


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    """Raise RequestRefused when a prompt of `num_tokens` leaves the context no room for output."""
    if num_tokens >= max_model_len:
        raise RequestRefused(f"The prompt has {num_tokens} tokens, but this model's maximum context length is "
                             f"{max_model_len} tokens (max_model_len), which leaves no room for output", "prompt",
                             "context_length_exceeded")


def check_prompt(prompt_token_ids: Sequence[int], max_tokens: int | None, max_model_len: int, vocab_size: int,
                 min_tokens: int = 0) -> None:
    """Raise RequestRefused naming the numbers when a prompt cannot be served as asked."""
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestRefused("The prompt is empty; it needs at least one token", "prompt")
    check_prompt_length(n, max_model_len)
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise RequestRefused(f"This model's maximum context length is {max_model_len} tokens, but "
                             f"{n + max_tokens} were requested ({n} in the prompt and {max_tokens} for the "
                             "completion)", "max_tokens", "context_length_exceeded")
    if max_tokens is None and n + min_tokens > max_model_len:
        # without max_tokens the output runs to the end of the context, which ends it before
        # min_tokens: refused, as vLLM refuses a min_tokens past the max_tokens it fills in
        raise RequestRefused(f"min_tokens ({min_tokens}) is more than the {max_model_len - n} tokens the context "
                             f"(max_model_len {max_model_len}) leaves after the prompt's {n}", "min_tokens",
                             "context_length_exceeded")
    check_token_ids(prompt_token_ids, vocab_size, "the prompt", "prompt")


PRIORITY_RANGE = (-2**63, 2**63 - 1)   # what the engine's messages carry


def check_priority(priority: int, policy: str) -> None:
    """Raise RequestRefused for a priority the scheduling policy cannot honour (vLLM's rule: only 0
    unless the policy is "priority") or one outside what the engine's messages carry."""
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise RequestRefused(f"'priority' must be an integer, got {priority!r:.40}", "priority")
    if priority != 0 and policy != "priority":
        raise RequestRefused(f"Priority scheduling is not enabled: this server serves requests first come, first "
                             f"served (--scheduling-policy {policy}), so 'priority' must be 0", "priority",
                             "unsupported_parameter")
    if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise RequestRefused(f"'priority' must be between {PRIORITY_RANGE[0]} and {PRIORITY_RANGE[1]}", "priority")


def logprobs_cap(max_logprobs: int, vocab_size: int) -> int:
    """The most alternatives a request may ask for: max_logprobs, at most the vocabulary."""
    return min(max_logprobs, vocab_size)


def check_logprobs(params: SamplingParams, cap: int) -> None:
    """Raise RequestRefused when logprobs or prompt_logprobs ask for more alternatives than `cap`
    (logprobs_cap), as vLLM refuses what passes its --max-logprobs."""
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is not None and asked > cap:
            raise RequestRefused(f"{name} asks for {asked} alternatives; this engine returns at most {cap} "
                                 "(max_logprobs; --max-logprobs for serve)", name)


def check_params_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raise RequestRefused for a logit_bias, stop_token_ids or allowed_token_ids id outside the
    vocabulary (the sampler indexes the logits by them), or for more allowed ids than it has."""
    if params.logit_bias:
        check_token_ids(list(params.logit_bias), vocab_size, "'logit_bias'", "logit_bias")
    check_token_ids(params.stop_token_ids, vocab_size, "'stop_token_ids'", "stop_token_ids")
    allowed = params.allowed_token_ids
    if allowed is not None:
        if len(allowed) > vocab_size:
            # each id is uploaded every step the request samples: the list is bounded by what it can name
            raise RequestRefused(f"'allowed_token_ids' has {len(allowed)} ids, more than the {vocab_size} tokens of "
                                 "the vocabulary", "allowed_token_ids")
        check_token_ids(allowed, vocab_size, "'allowed_token_ids'", "allowed_token_ids")
