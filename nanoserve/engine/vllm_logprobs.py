"""The offline API's logprobs in vLLM's form: per position a dict {token id: Logprob}, the scored
token first (its own rank), then its top-N alternatives (ranks 1..N), as vLLM's LLM returns them.
Scripts written for vLLM read `outputs[0].logprobs[i][token_id].logprob`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from nanoserve.engine.messages import TokenLogprob
from nanoserve.engine.prompt_logprobs import PromptTokenLogprob


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's Logprob: a token's log-probability, its rank (1 = the model's first choice), its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]


def no_text(token_id: int) -> None:
    """The decoder of a request that does not detokenize."""
    return None


def token_decoder(tokenizer: PreTrainedTokenizerBase, detokenize: bool) -> Callable[[int], str | None]:
    """Each token's text as vLLM's decoded_token gives it (the token decoded alone), looked up once
    per id; None for every token when the request does not detokenize."""
    if not detokenize:
        return no_text
    texts: dict[int, str] = {}

    def decode(token_id: int) -> str:
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = tokenizer.decode([token_id])
        return text

    return decode


def position_logprobs(token_id: int, entry: TokenLogprob | PromptTokenLogprob,
                      decode: Callable[[int], str | None]) -> PositionLogprobs:
    """One position's dict: the scored token under its own rank, then each alternative under its
    place in the top list (a scored token among them keeps its place first, as in vLLM)."""
    logprob, alternatives, rank = entry
    scored = {token_id: Logprob(logprob, rank, decode(token_id))}
    for place, (alternative, value) in enumerate(alternatives, 1):
        scored[alternative] = Logprob(value, place, decode(alternative))
    return scored


def sequence_logprobs(token_ids: list[int], entries: list, decode: Callable[[int], str | None]
                      ) -> list[PositionLogprobs | None]:
    """`position_logprobs` of each token; None where its entry is None (a prompt's first token)."""
    return [None if entry is None else position_logprobs(token_id, entry, decode)
            for token_id, entry in zip(token_ids, entries)]
