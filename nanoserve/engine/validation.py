"""The one check of a prompt before it is queued, at whichever door it comes in (LLM or AsyncEngine)."""

from __future__ import annotations

from collections.abc import Sequence


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    """Raise ValueError naming the first id outside the vocabulary."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return  # min and max run at C speed: the common case costs microseconds
    bad = next(t for t in token_ids if not 0 <= t < vocab_size)
    raise ValueError(f"Token id {bad} in {what} is out of range: the vocabulary has {vocab_size} tokens")


class ContextLengthError(ValueError):
    """The prompt, or the prompt with max_tokens, does not fit max_model_len; `param` names the field to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_prompt(prompt_token_ids: Sequence[int], max_tokens: int | None, max_model_len: int, vocab_size: int) -> None:
    """Raise ValueError naming the numbers when a prompt cannot be served as asked."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("The prompt is empty; it needs at least one token")
    if n >= max_model_len:
        raise ContextLengthError(f"The prompt has {n} tokens, but this model's maximum context length is "
                                 f"{max_model_len} tokens (max_model_len), which leaves no room for output", "prompt")
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise ContextLengthError(f"This model's maximum context length is {max_model_len} tokens, but "
                                 f"{n + max_tokens} were requested ({n} in the prompt and {max_tokens} for the "
                                 "completion)", "max_tokens")
    check_token_ids(prompt_token_ids, vocab_size, "the prompt")
