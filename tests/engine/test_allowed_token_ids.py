"""allowed_token_ids through the engine: greedy equals transformers' argmax over the masked logits,
and no path (n > 1, seeds, filters, penalties, bias, logprobs, grammars, pipelining) leaves the list."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.structured_outputs_params import StructuredOutputsParams
from tests.conftest import random_prompts

VOCAB = 384
ALLOWED = [3, 17, 42, 99, 150, 151, 200, 263, 300, 383]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(qwen3_model, request) -> LLM:
    return LLM(qwen3_model, dtype="float32", device="cpu", block_size=8, num_kvcache_blocks=128,
               max_model_len=128, async_scheduling=request.param)


def hf_masked_greedy(model_path: str, prompt: list[int], allowed: list[int], steps: int) -> list[int]:
    """transformers' logits, masked to `allowed` and argmaxed, one token at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    mask = torch.full((model.config.vocab_size,), float("-inf"))
    mask[allowed] = 0.0
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int((logits + mask).argmax()))
    return ids[len(prompt):]


def test_greedy_is_the_argmax_of_the_masked_transformers_logits(llm, qwen3_model):
    prompts = random_prompts(2, VOCAB, 5, 20, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, allowed_token_ids=ALLOWED)
    outs = llm.generate(prompts, params, use_tqdm=False)
    free = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, out, unlimited in zip(prompts, outs, free):
        assert out.token_ids == hf_masked_greedy(qwen3_model, prompt, ALLOWED, 10)
        assert any(t not in ALLOWED for t in unlimited.token_ids)  # the list changed something


def test_every_kind_of_request_stays_in_its_list_beside_one_without(llm):
    prompts = random_prompts(1, VOCAB, 12, 12, seed=22)
    alone = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].token_ids
    kinds = [dict(temperature=1.0, n=3, seed=7), dict(temperature=1.2, top_k=4, n=2),
             dict(temperature=0.9, top_p=0.8, min_p=0.05), dict(temperature=0.0, presence_penalty=2.0,
                                                                 repetition_penalty=1.3),
             dict(temperature=0.7, logit_bias={5: 100.0}, logprobs=2), dict(temperature=0.0, frequency_penalty=2.0)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, allowed_token_ids=ALLOWED, **kw) for kw in kinds]
    outs = llm.generate(prompts * (len(kinds) + 1), params + [SamplingParams(temperature=0.0, max_tokens=12,
                                                                             ignore_eos=True)], use_tqdm=False)
    for out in outs[:-1]:
        for choice in out.outputs:
            assert len(choice.token_ids) == 12 and set(choice.token_ids) <= set(ALLOWED), choice.token_ids
    assert outs[-1].token_ids == alone  # its neighbours' lists never reach it
    # logprobs are the model's own: the best alternative is often outside the list
    biased = outs[4].outputs[0]
    tops = [[t for t, lp in entry.items() if lp.rank <= 2] for entry in biased.logprobs]
    assert all(len(top) == 2 for top in tops)
    assert any(t not in ALLOWED for top in tops for t in top)
    # a seed gives the same draw again
    again = llm.generate(prompts, params[0], use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in outs[0].outputs]


def test_a_grammar_and_a_list_both_hold_and_the_grammar_wins_where_they_share_nothing(llm):
    tok = llm.tokenizer
    choices = ["dog", "fox"]
    spec = StructuredOutputsParams(choice=choices)
    eos = tok.eos_token_id
    fox = tok.encode("fox")
    for choice, ids in (("fox", fox + [eos]), ("dog", tok.encode("dog") + [eos])):
        out = llm.generate(["The quick brown"], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=spec,
                                                              allowed_token_ids=ids), use_tqdm=False)[0]
        assert out.text == choice
    # a list that shares no token with the grammar: the grammar's output, not a token from nowhere
    none = llm.generate(["The quick brown"], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=spec,
                                                           allowed_token_ids=[VOCAB - 1]), use_tqdm=False)[0]
    assert none.text in choices


@pytest.mark.parametrize("ids, match", [([VOCAB], "out of range"), ([-3], "allowed_token_ids"),
                                        (list(range(VOCAB)) * 2, "more than the 384 tokens"),
                                        ([], "at least one")])
def test_a_bad_list_is_refused_before_anything_is_queued(llm, ids, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=3), SamplingParams(allowed_token_ids=ids)],
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # the whole vocabulary, each id once, is a list like any other
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                   allowed_token_ids=list(range(VOCAB))), use_tqdm=False)
    assert len(out[0].token_ids) == 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_list_of_stop_tokens_holds_before_min_tokens_as_a_grammar_does(llm, temperature):
    # min_tokens bans the stop tokens: with nothing but them allowed every logit was -inf, and the
    # sampler drew token 0, outside the list (here an EOS, three times, each ignored before min_tokens)
    stop = ALLOWED[0]
    params = SamplingParams(temperature=temperature, max_tokens=6, min_tokens=3, allowed_token_ids=[stop],
                            stop_token_ids=[stop])
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [stop] * 3 and out.finish_reason == "stop"
