"""The offline API's logprobs in vLLM's form: per position {token id: Logprob(logprob, rank,
decoded_token)}, the scored token first under its own rank, then the top-N under ranks 1..N, each
value transformers' log-softmax of the model's own logits."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, Logprob, SamplingParams
from nanoserve.config import DEFAULT_MODEL
from tests.conftest import assert_rank, hf_logprobs

TOP = 3


@pytest.fixture(scope="module")
def llm():
    with LLM(DEFAULT_MODEL, device="cpu", dtype="float32") as model:
        yield model


def assert_position(entry: dict, token: int, row: torch.Tensor, top_n: int, decode) -> None:
    target = row[token].item()
    assert next(iter(entry)) == token   # the scored token first, as vLLM lists it
    scored = entry[token]
    assert scored.logprob == pytest.approx(target, abs=1e-4)
    assert_rank(row, target, scored.rank)
    ranked = sorted(entry.items(), key=lambda item: item[1].rank)
    top = ranked[:top_n]
    assert [lp.rank for _, lp in top] == list(range(1, top_n + 1))
    assert [lp.logprob for _, lp in top] == pytest.approx(row.topk(top_n).values.tolist(), abs=1e-4)
    assert [row[t].item() for t, _ in top] == pytest.approx([lp.logprob for _, lp in top], abs=1e-4)
    # the scored token is one of the top-N or one entry more
    assert len(entry) == top_n + (scored.rank > top_n)
    assert all(lp.decoded_token == decode(t) for t, lp in entry.items())


def test_sampled_and_prompt_logprobs_are_vllms_dicts_of_transformers_values(llm):
    prompt = "The weather in the old town today is"
    # sampled at temperature 1: most picks are not the model's first choice, so their rank shows
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logprobs=TOP, prompt_logprobs=2)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    ids = out.prompt_token_ids + completion.token_ids
    rows = hf_logprobs(DEFAULT_MODEL, ids)
    decode = lambda t: llm.tokenizer.decode([t])   # noqa: E731
    assert len(completion.logprobs) == len(completion.token_ids) == 12
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert_position(entry, token, rows[len(out.prompt_token_ids) - 1 + step], TOP, decode)
    assert any(entry[token].rank > TOP for token, entry in zip(completion.token_ids, completion.logprobs))
    assert completion.cumulative_logprob == pytest.approx(
        sum(entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for position, entry in enumerate(out.prompt_logprobs[1:]):
        assert_position(entry, out.prompt_token_ids[position + 1], rows[position], 2, decode)


def test_without_detokenizing_the_tokens_have_no_text_and_no_alternatives_mean_the_token_alone(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0,
                                               detokenize=False), use_tqdm=False)[0].outputs[0]
    assert [list(entry) for entry in out.logprobs] == [[token] for token in out.token_ids]
    assert all(entry[token] == Logprob(entry[token].logprob, 1, None) for token, entry in zip(out.token_ids, out.logprobs))
    plain = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    assert plain.prompt_logprobs is None
