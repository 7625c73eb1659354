"""The prompt_logprobs JSON, written from packed arrays, is byte for byte what a list of dicts of
the same Python floats gives to orjson (how it was written before the arrays): vLLM's shape, the
prompt token first with its own rank, its alternatives after it unless they name it."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from transformers import AutoTokenizer

from nanoserve.defaults import DEFAULT_MODEL
from nanoserve.engine.prompt_logprobs import PromptLogprobBuffer
from nanoserve.runner.batch import PromptScores
from nanoserve.server.logprobs import TokenTexts
from nanoserve.server.prompt_logprobs import prompt_logprobs_json

TOP = 5


@pytest.fixture(scope="module")
def texts() -> TokenTexts:
    return TokenTexts(AutoTokenizer.from_pretrained(DEFAULT_MODEL))


def dict_entries(texts: TokenTexts, token_ids: list[int], entries: list, top_n: int) -> list[dict | None]:
    """The prompt_logprobs as dicts, built from the listed form."""
    out: list[dict | None] = [None]
    for token_id, (chosen, alternatives, rank) in zip(token_ids[1:], entries[1:]):
        tokens = {str(token_id): entry(texts, token_id, chosen, rank)}
        for r, (tid, lp) in enumerate(alternatives[:top_n], start=1):
            tokens.setdefault(str(tid), entry(texts, tid, lp, r))
        out.append(tokens)
    return out


def entry(texts: TokenTexts, token_id: int, logprob: float, rank: int) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": texts.get(token_id)[0].decode("utf-8", "replace")}


def scored_prompt(tokenizer_size: int, num_tokens: int, top_n: int, seed: int) -> tuple[list[int], PromptLogprobBuffer]:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, tokenizer_size, num_tokens).tolist()
    rows = num_tokens - 1
    # every float32 exponent from tiny to MIN_LOGPROB: -1.5e-07 and -9999.0 are written differently
    logprobs = -np.exp(rng.uniform(-16, 9.2, rows)).astype(np.float32)
    logprobs[::7] = -9999.0
    ids = np.argsort(rng.random((rows, tokenizer_size)), axis=1)[:, :top_n].astype(np.int32)   # distinct per row
    # the prompt token among its own alternatives, now and then: it must not be listed twice
    named = rng.random(rows) < 0.4
    if top_n:
        ids[named, rng.integers(0, top_n, rows)[named]] = np.asarray(prompt[1:])[named]
    top = np.sort(-np.exp(rng.uniform(-16, 9.2, (rows, top_n))).astype(np.float32), axis=1)[:, ::-1]
    buffer = PromptLogprobBuffer(num_tokens, top_n)
    buffer.write(0, PromptScores(logprobs, rng.integers(1, tokenizer_size, rows, dtype=np.int32), ids,
                                 np.ascontiguousarray(top)))
    return prompt, buffer


@pytest.mark.parametrize("top_n, shown", [(TOP, TOP), (TOP, 2), (0, 0), (3, 0)])
def test_the_packed_json_is_what_dicts_of_the_same_floats_give(texts, top_n, shown):
    size = len(texts.tokenizer)
    prompt, buffer = scored_prompt(size, 300, top_n, seed=top_n * 10 + shown)
    if top_n:   # a byte-fallback token (half of "é") and a special token among the alternatives
        buffer.top_ids[0, 0] = texts.tokenizer.encode("é", add_special_tokens=False)[0]
        buffer.top_ids[0, -1] = texts.tokenizer.all_special_ids[0]
    packed = buffer.packed()
    written = prompt_logprobs_json(texts, prompt, packed, shown)
    assert written == orjson.dumps(dict_entries(texts, prompt, packed.entries(), shown))
    parsed = orjson.loads(written)
    assert parsed[0] is None and len(parsed) == len(prompt)
    assert all(next(iter(e)) == str(t) for t, e in zip(prompt[1:], parsed[1:]))


def test_a_one_token_prompt_is_one_null(texts):
    prompt, buffer = scored_prompt(len(texts.tokenizer), 1, TOP, seed=0)
    assert prompt_logprobs_json(texts, prompt, buffer.packed(), TOP) == b"[null]"
