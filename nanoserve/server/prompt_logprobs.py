"""vLLM's `prompt_logprobs` as JSON bytes, written straight from a prompt's packed arrays.

Per prompt token null (the first: nothing predicts it), else {token id: {"logprob", "rank",
"decoded_token"}} for the token itself (its rank from the engine, over the whole vocabulary), then
its top_n alternatives (ranks 1..top_n) that are not the token. The numbers are written by orjson
from Python floats of the float32 values, as a dict of them would be; no dict per entry is built:
16 prompts of 2,000 tokens with 20 alternatives were 700k of them, which the garbage collector
walked while the response was written.
"""

from __future__ import annotations

import numpy as np
import orjson

from nanoserve.engine.outputs import PromptLogprobs
from nanoserve.server.logprobs import TokenTexts


def _json_numbers(values: np.ndarray) -> list[bytes]:
    """Each number as orjson writes it in a list: floats go through Python floats (float32 widened
    exactly), so each one reads as it did when the engine's values were Python floats."""
    written = orjson.dumps(values.tolist())
    return written[1:-1].split(b",") if len(values) else []


class _TokenPieces:
    """The JSON around one token's numbers: its key (first in its object, or after another) and,
    after its rank, its decoded text; made once per token of a response."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.first: dict[int, bytes] = {}
        self.later: dict[int, bytes] = {}
        self.tails: dict[int, bytes] = {}

    def add(self, token_id: int) -> None:
        key = b'"%d":{"logprob":' % token_id
        self.first[token_id], self.later[token_id] = key, b"," + key
        # as vLLM's detokenizer writes one token: a piece of a character is U+FFFD, not "bytes:..."
        decoded = self.texts.get(token_id)[0].decode("utf-8", "replace")
        self.tails[token_id] = b',"decoded_token":' + orjson.dumps(decoded) + b"}"


def prompt_logprobs_json(texts: TokenTexts, token_ids: list[int], scored: PromptLogprobs, top_n: int) -> bytes:
    """The JSON list of a prompt's `prompt_logprobs` (`token_ids`, scored by the engine), with
    `top_n` alternatives per token (the engine may have scored more)."""
    top_n = min(top_n, scored.top_n)
    chosen, ranks = _json_numbers(scored.logprobs), _json_numbers(scored.ranks)
    top_ids = scored.top_ids[:, :top_n]
    values = _json_numbers(scored.top_logprobs[:, :top_n].ravel())
    pieces = _TokenPieces(texts)
    for token_id in set(token_ids[1:]).union(np.unique(top_ids).tolist()):
        pieces.add(token_id)
    first, later, tails = pieces.first, pieces.later, pieces.tails
    rank_fields = [b',"rank":%d' % r for r in range(1, top_n + 1)]
    parts = [b"[null"]
    for row, (token_id, alternatives) in enumerate(zip(token_ids[1:], top_ids.tolist())):
        parts += (b",{", first[token_id], chosen[row], b',"rank":', ranks[row], tails[token_id])
        at = row * top_n
        for j, alternative in enumerate(alternatives):
            if alternative != token_id:   # listed once, first, with its own rank
                parts += (later[alternative], values[at + j], rank_fields[j], tails[alternative])
        parts.append(b"}")
    parts.append(b"]")
    return b"".join(parts)
