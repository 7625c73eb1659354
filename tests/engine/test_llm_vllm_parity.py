"""What code written for vLLM's offline LLM does here: its prompt dicts, its defaults from the
model's generation_config.json, SamplingParams reused and changed between calls, calls from two
threads, OpenAI content parts in chat, and vLLM's spellings of "none"."""

from __future__ import annotations

import copy
import json
import pathlib
import pickle
import shutil
import threading

import numpy as np
import pytest

import nanoserve
from nanoserve import LLM, EngineConfig, SamplingParams
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


def test_reset_prefix_cache_makes_the_next_run_cold_and_is_refused_while_generating(llm):
    prompt = "A long shared preamble for every request " * 8
    llm.generate(prompt, greedy(), use_tqdm=False)
    warm = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    assert warm.num_cached_tokens > 0
    assert llm.reset_prefix_cache()
    cold = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0 and cold.token_ids == warm.token_ids

    refused = []
    step = llm.engine.step

    def step_then_reset():   # while generate() holds its requests
        if not refused:
            refused.append(not llm.reset_prefix_cache() and not llm.engine.reset_prefix_cache())
        return step()

    llm.engine.step = step_then_reset
    try:
        llm.generate(prompt, greedy(), use_tqdm=False)
    finally:
        del llm.engine.step
    assert refused == [True]
    assert llm.generate(prompt, greedy(), use_tqdm=False)[0].num_cached_tokens > 0   # nothing was forgotten


def test_none_for_an_engine_argument_means_its_default_and_a_wrong_type_is_named():
    # vLLM's engine arguments are Optional: code passes its own None through. seed=None failed on a
    # comparison, and enable_prefix_caching=None turned the prefix cache off
    config = EngineConfig(device="cpu", seed=None, max_num_seqs=None, enable_prefix_caching=None,
                          max_model_len=None, gpu_memory_utilization=None, tensor_parallel_size=None)
    assert (config.seed, config.max_num_seqs, config.enable_prefix_caching, config.gpu_memory_utilization,
            config.tensor_parallel_size) == (0, 256, True, 0.9, 1)
    assert config.max_model_len == EngineConfig(device="cpu").max_model_len
    from_path = EngineConfig(model=pathlib.Path(DEFAULT_MODEL), device="cpu", max_num_seqs=np.int64(4))
    assert (from_path.model, type(from_path.max_num_seqs)) == (DEFAULT_MODEL, int)
    assert type(from_path.model) is str   # a Path stayed one, though the config's fields are strings
    for field, bad, words in (("max_model_len", 64.0, "an integer"), ("seed", "0", "an integer"),
                              ("enforce_eager", "yes", "True or False"), ("gpu_memory_utilization", "0.5", "a number"),
                              ("enable_prefix_caching", 1, "True or False"), ("kv_cache_dtype", 8, "a string")):
        with pytest.raises(ValueError, match=f"{field} must be {words}, got {bad!r}"):
            EngineConfig(device="cpu", **{field: bad})


def test_vllms_structured_output_options_and_chat_arguments_are_taken(llm):
    from nanoserve.sampling_params import StructuredOutputsParams   # where vLLM's is
    assert StructuredOutputsParams is nanoserve.StructuredOutputsParams
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compact = StructuredOutputsParams(json=schema, disable_any_whitespace=True, disable_fallback=True,
                                      disable_additional_properties=True)
    assert not compact.any_whitespace and StructuredOutputsParams(json=schema).any_whitespace
    out = llm.generate("A", SamplingParams(temperature=0, max_tokens=24, structured_outputs=compact),
                       use_tqdm=False)[0].text
    assert out == json.dumps(json.loads(out)) and json.loads(out).keys() == {"a"}, out   # one layout, json.dumps's
    for option in ({"whitespace_pattern": " "}, {"structural_tag": "{}"}):
        with pytest.raises(ValueError, match=f"{next(iter(option))} is not supported"):
            StructuredOutputsParams(json=schema, **option)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    plain = llm.chat(messages, greedy(), use_tqdm=False)[0].token_ids
    assert llm.chat(messages, greedy(), use_tqdm=False, chat_template_content_format="string",
                    mm_processor_kwargs=None)[0].token_ids == plain
    with pytest.raises(ValueError, match="chat_template_content_format 'openai' is not offered"):
        llm.chat(messages, greedy(), use_tqdm=False, chat_template_content_format="openai")
    with pytest.raises(ValueError, match="text-only"):
        llm.chat(messages, greedy(), use_tqdm=False, mm_processor_kwargs={"size": 1})


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
    for parts in ([{"type": "input_text", "text": "Hi"}, {"type": "output_text", "text": "there"}],
                  [{"type": "text", "text": "Hi"}, {"type": "refusal", "refusal": "there"}]):
        as_other_parts = llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)[0]
        assert as_other_parts.prompt_token_ids == as_text.prompt_token_ids
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
    assert out.finished and out.outputs[0].finished()
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(entry[token].logprob for token, entry in zip(out.token_ids, out.outputs[0].logprobs)))
    assert out.outputs[0].cumulative_logprob < 0
    assert llm.generate("Hello", greedy(2), use_tqdm=False)[0].outputs[0].cumulative_logprob is None


def test_outputs_pickle_with_their_logprobs(llm):
    # scripts save results and pass them between processes; the prompt logprobs' token decoder (a
    # closure over the tokenizer) made every output unpicklable
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=4, logprobs=2, prompt_logprobs=1)
    outs = llm.generate(["Hello there", "A list"], params, use_tqdm=False)
    for out in pickle.loads(pickle.dumps(outs)) + copy.deepcopy(outs):
        original = outs[0] if out.prompt_token_ids == outs[0].prompt_token_ids else outs[1]
        assert out.prompt_logprobs == original.prompt_logprobs and out.prompt_logprobs[1]
        assert out.outputs[0].logprobs == original.outputs[0].logprobs
        assert out.outputs[0].finished() and out.token_ids == original.token_ids
    ids = llm.generate("Hi", SamplingParams(max_tokens=3, detokenize=False, prompt_logprobs=0), use_tqdm=False)
    assert pickle.loads(pickle.dumps(ids))[0].prompt_logprobs == ids[0].prompt_logprobs


@pytest.mark.parametrize("prompt", [b"Hi", [b"Hi"], None, 5, [1.5, 2.0], ["Hi", None]])
def test_what_is_no_prompt_is_a_type_error_and_the_next_call_works(llm, prompt):
    before = llm.generate("Hi", greedy(3), use_tqdm=False)[0].token_ids
    with pytest.raises((TypeError, ValueError), match="prompt"):
        llm.generate(prompt, greedy(3), use_tqdm=False)
    assert llm.generate("Hi", greedy(3), use_tqdm=False)[0].token_ids == before


def test_n_is_bounded(llm):
    assert SamplingParams(n=16384).n == 16384
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=10**9)


def test_chat_template_kwargs_win_over_the_arguments_as_in_vllm(llm):
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    as_argument = llm.chat(conversation, greedy(3), add_generation_prompt=False, continue_final_message=True,
                           use_tqdm=False)[0]
    as_kwargs = llm.chat(conversation, greedy(3), chat_template_kwargs={
        "add_generation_prompt": False, "continue_final_message": True, "tokenize": True}, use_tqdm=False)[0]
    assert as_kwargs.prompt_token_ids == as_argument.prompt_token_ids
    opened = llm.chat(conversation, greedy(3), use_tqdm=False)[0]
    assert opened.prompt_token_ids != as_argument.prompt_token_ids
    with pytest.raises(TypeError, match="conversation"):
        llm.chat("Hi", greedy(3))


def test_stop_reason_is_none_for_the_tokenizers_eos_and_names_any_other_stop_token(llm):
    # vLLM checks the tokenizer's EOS first (no stop reason) and adds the other EOS ids of
    # generation_config.json to the stop ids, so they are named: Qwen3's <|endoftext|> beside <|im_end|>
    eos = llm.tokenizer.eos_token_id
    others = sorted(set(llm.engine.eos_token_ids) - {eos})
    assert others, "the bundled model's generation_config.json names a second EOS id"

    def end(token: int, **fields) -> tuple:
        out = llm.generate("Hi", SamplingParams(max_tokens=3, allowed_token_ids=[token], **fields),
                           use_tqdm=False)[0].outputs[0]
        return out.finish_reason, out.stop_reason, out.token_ids

    assert end(eos) == ("stop", None, [eos])
    assert end(others[0]) == ("stop", others[0], [others[0]])
    assert end(eos, stop_token_ids=[eos]) == ("stop", None, [eos])
    assert end(eos, stop_token_ids=[eos], ignore_eos=True) == ("stop", eos, [eos])
    assert end(others[0], ignore_eos=True) == ("length", None, [others[0]] * 3)


def test_truncate_prompt_tokens_keeps_the_prompts_end_and_clone_copies(llm):
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog " * 3)
    whole = llm.generate({"prompt_token_ids": ids[-5:]}, greedy(4), use_tqdm=False)[0]
    cut = llm.generate({"prompt_token_ids": ids}, greedy(4, truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-5:] and cut.token_ids == whole.token_ids
    assert llm.generate({"prompt_token_ids": ids}, greedy(4, truncate_prompt_tokens=-1),
                        use_tqdm=False)[0].prompt_token_ids == ids   # shorter than max_model_len: all of it
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    params = SamplingParams(stop=["x"], logit_bias={3: 1.0})
    copy_ = params.clone()
    copy_.stop.append("y")
    assert params.stop == ["x"] and copy_.logit_bias == params.logit_bias
