"""vLLM's bad_words through the engine: tokenized as vLLM does, and the token that would complete a
bad word is never sampled, in sync and pipelined scheduling alike."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.config import DEFAULT_MODEL
from nanoserve.engine.bad_words import BadWords, bad_words_token_ids
from nanoserve.sampling_params import InvalidSamplingParam

PROMPT = "A list is"


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request) -> LLM:
    return LLM(DEFAULT_MODEL, device="cpu", num_kvcache_blocks=256, block_size=16,
               async_scheduling=request.param)


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_words_are_tokenized_bare_and_after_a_space_where_that_keeps_their_length(llm):
    tok = llm.tokenizer
    for word in ("key", "found,", "not-keyobj."):
        bare, spaced = tok.encode(word, add_special_tokens=False), tok.encode(" " + word, add_special_tokens=False)
        expected = [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])
        assert bad_words_token_ids(tok, [word]) == expected
        assert bad_words_token_ids(tok, ["  " + word]) == expected  # leading whitespace is stripped first


def test_a_ban_needs_the_rest_of_the_word_among_the_generated_tokens():
    words = BadWords([[5], [7, 8, 9], [3, 9]], vocab_size=100)
    assert words.banned([1, 2], 2, 2) == (5,)              # no output yet: single tokens only
    assert words.banned([1, 7, 8], 1, 3) == (5, 9)         # 7 8 generated: 9 would complete the word
    assert words.banned([7, 8], 1, 2) == (5,)              # the 7 is the prompt's, not generated
    assert set(words.banned([0, 3, 7, 8], 1, 4)) == {5, 9}
    assert BadWords([[150]], vocab_size=100).banned([1], 1, 1) == ()  # past the vocabulary: never drawn


def test_no_bad_word_is_ever_completed_greedy_or_sampled(llm):
    tok = llm.tokenizer
    free = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    # words of the free text that take several tokens, so that the ban depends on what came before
    bad = [w for w in free.text.split() if len(tok.encode(w, add_special_tokens=False)) > 1][:3]
    sequences = bad_words_token_ids(tok, bad)
    assert bad and any(contains(free.token_ids, s) for s in sequences)  # the list changes something
    kinds = [dict(temperature=0.0), dict(temperature=1.0, n=3, seed=3), dict(temperature=0.8, top_k=5),
             dict(temperature=0.0, presence_penalty=1.0, logprobs=1), dict(temperature=0.0, min_tokens=5)]
    outs = llm.generate([PROMPT] * len(kinds), [SamplingParams(max_tokens=30, ignore_eos=True, bad_words=bad, **kw)
                                               for kw in kinds], use_tqdm=False)
    for out in outs:
        for choice in out.outputs:
            assert not any(contains(choice.token_ids, s) for s in sequences), (choice.text, bad)


def test_bad_words_are_bounded_and_never_blank():
    for words in (["x"] * 129, ["x" * 257], ["  "], [""]):
        with pytest.raises(InvalidSamplingParam) as caught:
            SamplingParams(bad_words=words)
        assert caught.value.param == "bad_words"


def test_greedy_equals_transformers_no_bad_words_processor(llm):
    """transformers' NoBadWordsLogitsProcessor (generate's bad_words_ids) on the same ids; it also
    looks back into the prompt, so the words are chosen where that cannot matter."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = llm.tokenizer
    exact = LLM(DEFAULT_MODEL, dtype="float32", device="cpu", num_kvcache_blocks=256, block_size=16)
    free = exact.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                          use_tqdm=False)[0]
    bad = [w for w in free.text.split() if len(tok.encode(w, add_special_tokens=False)) > 1][:3]
    sequences = bad_words_token_ids(tok, bad)
    prompt = tok.encode(PROMPT)
    assert not any(prompt[-1] in s[:-1] for s in sequences)
    ours = exact.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, bad_words=bad),
                          use_tqdm=False)[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=20, do_sample=False, bad_words_ids=sequences, pad_token_id=0)
    assert ours == ref[0, len(prompt):].tolist() and ours != free.token_ids


def test_a_requests_bad_words_are_tokenized_once_whatever_its_n(llm, monkeypatch):
    """Its n choices share one tokenization: 128 words of 256 characters took ~65 ms, once per
    choice in the engine's loop, which held every other request for 8 s at n=128."""
    words = ["not-keyobj.", "found,"]
    calls = []
    encode = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **kw: calls.append(a) or encode(*a, **kw))
    params = SamplingParams(max_tokens=3, ignore_eos=True, n=8, seed=0, bad_words=words)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(out.outputs) == 8
    assert len([a for a in calls if a[0].strip() in words]) == 2 * len(words)  # bare and after a space


def test_the_engine_client_tokenizes_bad_words_once_for_every_prompt_and_choice(monkeypatch):
    import asyncio

    from nanoserve import EngineConfig
    from nanoserve.engine.async_engine import AsyncEngine
    from nanoserve.engine.llm_engine import LLMEngine

    async def main() -> None:
        config = EngineConfig(model=DEFAULT_MODEL, device="cpu", dtype="float32", num_kvcache_blocks=256, block_size=16)
        engine = AsyncEngine(config, engine=LLMEngine(config))
        await engine.start()
        calls = []
        encode = engine.tokenizer.encode
        monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **kw: calls.append(a) or encode(*a, **kw))
        try:
            params = SamplingParams(max_tokens=3, ignore_eos=True, n=4, bad_words=["found,"])
            stream = engine.add_request("bad", [[5, 6, 7], [8, 9]], params)
            async for _ in stream:
                pass
            assert len(stream.outputs) == 8
            assert len([a for a in calls if a[0].strip() == "found,"]) == 2
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_an_allow_list_wholly_banned_keeps_its_bad_words_and_lets_min_tokens_give_way(llm):
    # allowed: an EOS and a bad word's token. Every ban was dropped together, and the bad word came out
    tok = llm.tokenizer
    (word,) = tok.encode("H", add_special_tokens=False)
    eos = tok.eos_token_id
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5, min_tokens=3, bad_words=["H"],
                                                allowed_token_ids=[eos, word]), use_tqdm=False)[0].outputs[0]
    assert word not in out.token_ids and out.token_ids[0] == eos
