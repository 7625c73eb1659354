"""Per-token rules of a sequence: what it may not sample next, and which token ends it."""

from __future__ import annotations

from nanoserve.engine.sequence import Sequence


def banned_tokens(seq: Sequence, end: int | None = None) -> tuple[int, ...]:
    """Stop tokens cannot be sampled before min_tokens outputs, nor a token that completes a
    bad word. `end`: how many of the sequence's tokens come before the one sampled (all)."""
    end = len(seq.token_ids) if end is None else end
    min_tokens = seq.params.min_tokens
    stops = tuple(seq.stop_token_ids) if min_tokens and end - seq.num_prompt_tokens < min_tokens else ()
    words = seq.bad_words.banned(seq.token_ids, seq.num_prompt_tokens, end) if seq.bad_words is not None else ()
    allowed = seq.params.allowed_token_ids
    # an allow list wholly banned stands, as a grammar does (all -inf, the sampler drew token 0
    # outside it): min_tokens gives way first, then the bad words
    for ban in (stops + words, words):
        if not ban or allowed is None or len(allowed) > len(ban) or not set(allowed) <= set(ban):
            return ban
    return ()


def finish_reason(seq: Sequence, token: int, num_output: int) -> str | None:
    """Why the sequence ends at this token: "stop" (a stop token past min_tokens) or "length"; None if it goes on."""
    if token in seq.stop_token_ids and num_output >= seq.params.min_tokens:
        return "stop"
    # max_tokens was capped at what the context leaves, so this also ends at max_model_len
    if num_output >= seq.max_tokens:
        return "length"
    return None
