"""What code written for vLLM's offline LLM does here: its prompt dicts, its defaults from the
model's generation_config.json, SamplingParams reused and changed between calls, calls from two
threads, OpenAI content parts in chat, and vLLM's spellings of "none"."""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.config import DEFAULT_MODEL


@pytest.fixture(scope="module")
def llm():
    with LLM(device="cpu") as model:
        yield model


def greedy(max_tokens: int = 8, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)


def test_vllms_prompt_dicts_are_prompts(llm):
    text = "The quick brown fox"
    ids = llm.tokenizer.encode(text)
    plain = llm.generate([text], greedy(), use_tqdm=False)[0]
    outs = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}, text], greedy(), use_tqdm=False)
    llm.generate(text + " jumps over the lazy dog" * 10, greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == [plain.token_ids] * 3
    assert [o.prompt for o in outs] == [text, None, text]
    assert llm.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)[0].token_ids == plain.token_ids
    long = text + " jumps over the lazy dog" * 10
    assert llm.generate({"prompt": long}, greedy(), use_tqdm=False)[0].num_cached_tokens > 0   # after the run above
    salted = llm.generate({"prompt": long, "cache_salt": "tenant-1"}, greedy(), use_tqdm=False)[0]
    assert salted.num_cached_tokens == 0   # the salt keeps its blocks apart
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": None}}, greedy(), use_tqdm=False)


def test_without_sampling_params_the_models_generation_config_sets_the_defaults(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "temperature": 0.0,
                                                               "max_new_tokens": 5}))
    prompt = "A list is"
    with LLM(str(folder), device="cpu") as model:
        assert model.get_default_sampling_params().temperature == 0.0
        first = model.generate(prompt, use_tqdm=False)[0]
        assert model.generate(prompt, use_tqdm=False)[0].token_ids == first.token_ids   # greedy
        assert len(first.token_ids) <= 5
        assert first.token_ids == model.generate(prompt, SamplingParams(temperature=0, max_tokens=5),
                                                 use_tqdm=False)[0].token_ids
    with LLM(str(folder), device="cpu", generation_config="vllm") as model:
        assert model.get_default_sampling_params() == SamplingParams()


def test_sampling_params_changed_between_calls_are_read_again(llm):
    # the engine's arrays made from logit_bias stayed on the caller's object: a changed bias was ignored
    params = greedy(4, logit_bias={5: 100.0})
    assert llm.generate("World", params, use_tqdm=False)[0].token_ids == [5] * 4
    params.logit_bias = {6: 100.0}
    assert llm.generate("World", params, use_tqdm=False)[0].token_ids == [6] * 4
    params.allowed_token_ids = [7]
    params.logit_bias = None
    assert llm.generate("World", params, use_tqdm=False)[0].token_ids == [7] * 4
    params.n = 0   # a value it would refuse: refused now, not an IndexError in the engine
    with pytest.raises(ValueError, match="n must be"):
        llm.generate("World", params, use_tqdm=False)


def test_calls_from_two_threads_take_turns_and_each_gets_its_own_outputs(llm):
    params = greedy(20)
    expected = {prompt: llm.generate([prompt], params, use_tqdm=False)[0].token_ids
                for prompt in ("Hello", "World", "The quick")}
    got: list[tuple[str, list[int]]] = []
    errors: list[BaseException] = []

    def run(prompts: list[str]) -> None:
        try:
            for _ in range(3):
                got.extend((o.prompt, o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in (["Hello", "World"], ["The quick"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(got) == 9
    assert all(ids == expected[prompt] for prompt, ids in got)


def test_chat_takes_openai_content_parts_as_their_text(llm):
    params = greedy()
    as_text = llm.chat([{"role": "user", "content": "Hi\nthere"}], params, use_tqdm=False)[0]
    as_parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                      {"type": "text", "text": "there"}]}], params, use_tqdm=False)[0]
    assert as_parts.prompt_token_ids == as_text.prompt_token_ids and as_parts.token_ids == as_text.token_ids
    with pytest.raises(ValueError, match="text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)


def test_vllms_spellings_of_none(llm):
    assert SamplingParams(seed=-1).seed is None   # vLLM's "no seed"
    params = SamplingParams(stop=None, stop_token_ids=None, bad_words=None)
    assert (params.stop, params.stop_token_ids, params.bad_words) == ([], [], [])
    assert llm.generate("Hi", greedy(3), use_tqdm=False, lora_request=None)[0].token_ids
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate("Hi", greedy(3), lora_request=object())
    with pytest.raises(ValueError, match="need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)   # never matched: the text is not made
    assert llm.get_tokenizer() is llm.tokenizer


def test_outputs_say_they_finished_and_sum_their_logprobs(llm):
    out = llm.generate("Hello", greedy(5, logprobs=2), use_tqdm=False)[0]
    assert out.finished and out.outputs[0].finished
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(entry[token].logprob for token, entry in zip(out.token_ids, out.outputs[0].logprobs)))
    assert out.outputs[0].cumulative_logprob < 0
    assert llm.generate("Hello", greedy(2), use_tqdm=False)[0].outputs[0].cumulative_logprob is None
