"""The offline API: `LLM(...).generate(prompts, params)` on a random-weight Qwen3 (CPU, float32)."""

from __future__ import annotations

import numpy as np
import pytest

from nanoserve import LLM, SamplingParams
from tests.conftest import random_prompts

BLOCK_SIZE = 8
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def llm(qwen3_model) -> LLM:
    return LLM(qwen3_model, dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_kvcache_blocks=NUM_BLOCKS,
               max_model_len=128)


@pytest.fixture(autouse=True)
def every_block_is_free_afterwards(request):
    """After a test's generate calls nothing is left in the engine and every KV block is free."""
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == NUM_BLOCKS
        assert engine.block_manager.ref_counts == [0] * NUM_BLOCKS


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", True), **kw)


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_accepts_strings_and_token_id_lists(llm):
    text = "The quick brown fox"
    ids = llm.tokenizer.encode(text)
    outs = llm.generate([text, ids], greedy(6), use_tqdm=False)
    assert [o.prompt for o in outs] == [text, None]
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == ids
    assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) == 6
    # a single prompt of either kind, not wrapped in a list
    assert tokens(llm, text, greedy(6)) == [outs[0].token_ids]
    assert tokens(llm, ids, greedy(6)) == [outs[0].token_ids]


def test_one_sampling_params_per_prompt(llm):
    prompts = random_prompts(3, 384, 4, 12, seed=10)
    outs = llm.generate(prompts, [greedy(2), greedy(5), greedy(3)], use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [2, 5, 3]
    with pytest.raises(ValueError, match="3 SamplingParams for 2 prompts"):
        llm.generate(prompts[:2], [greedy(2)] * 3, use_tqdm=False)


def test_outputs_keep_the_prompt_order(llm):
    prompts = random_prompts(4, 384, 3, 40, seed=11)
    alone = [tokens(llm, [p], greedy(4))[0] for p in prompts]
    # the later requests finish first; the results still follow the prompts
    outs = llm.generate(prompts, [greedy(10), greedy(8), greedy(6), greedy(4)], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.token_ids[:4] for o in outs] == alone


def test_finish_reason_is_length_at_max_tokens(llm):
    out = llm.generate([[5, 6, 7]], greedy(7), use_tqdm=False)[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    # only the prompt must fit: the output stops at max_model_len (128)
    out = llm.generate([[5] * 120], greedy(32), use_tqdm=False)[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


def first_new_token(ids: list[int]) -> int:
    """Index of the first token after the first that did not appear before it; 0 if none."""
    return next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]), 0)


def test_stop_token_id_ends_the_request(llm):
    prompt = random_prompts(1, 384, 10, 10, seed=12)[0]
    free = tokens(llm, [prompt], greedy(16))[0]
    i = first_new_token(free)
    out = llm.generate([prompt], greedy(16, stop_token_ids=[free[i]]), use_tqdm=False)[0]
    assert out.token_ids == free[:i + 1]  # the stop token is the last token
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == free[i]


def test_min_tokens_holds_back_a_stop_token(llm):
    prompt = random_prompts(1, 384, 10, 10, seed=12)[0]
    free = tokens(llm, [prompt], greedy(16))[0]
    i = first_new_token(free)
    stop = free[i]
    out = llm.generate([prompt], greedy(16, stop_token_ids=[stop], min_tokens=i + 3), use_tqdm=False)[0]
    assert out.token_ids[:i] == free[:i]
    assert stop not in out.token_ids[:i + 3]
    assert len(out.token_ids) >= i + 3
    assert out.finish_reason == "length" or out.token_ids[-1] == stop


def test_eos_stops_unless_ignore_eos(llm):
    eos = llm.tokenizer.eos_token_id
    assert eos in llm.engine.eos_token_ids
    push_eos = {eos: 100.0}  # make EOS the certain greedy pick
    out = llm.generate([[5, 6, 7]], greedy(8, ignore_eos=False, logit_bias=push_eos), use_tqdm=False)[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = llm.generate([[5, 6, 7]], greedy(8, ignore_eos=True, logit_bias=push_eos), use_tqdm=False)[0]
    assert out.token_ids == [eos] * 8 and out.finish_reason == "length"
    out = llm.generate([[5, 6, 7]], greedy(8, ignore_eos=False, min_tokens=3, logit_bias=push_eos),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and eos not in out.token_ids[:3] and out.finish_reason == "stop"


def test_stop_string_cuts_the_text(llm):
    # random weights babble bytes: bias the pick towards ASCII letters for text a stop string can match
    letters = [t for t in range(llm.engine.vocab_size)
               if (piece := llm.tokenizer.decode([t])).isascii() and piece.isalpha()]
    params = dict(logit_bias=dict.fromkeys(letters, 50.0), presence_penalty=2.0)
    free = llm.generate(["A list holds items"], greedy(24, **params), use_tqdm=False)[0]
    text = free.text
    assert text == llm.tokenizer.decode(free.token_ids) and text.isascii()
    # a stop string from inside the text (its start if need be), at its first occurrence, well before the end
    start = next((i for i in range(1, len(text) - 8) if text.find(text[i:i + 2]) == i), 0)
    stop = text[start:start + 2]
    out = llm.generate(["A list holds items"], greedy(24, stop=[stop], **params), use_tqdm=False)[0]
    assert out.text == text[:start]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert len(out.token_ids) < len(free.token_ids)  # the request ended there, it did not run on
    assert out.token_ids == free.token_ids[:len(out.token_ids)]


def test_n_2_gives_two_outputs_and_the_second_shares_the_prompt_blocks(llm):
    prompt = random_prompts(1, 384, 37, 37, seed=13)[0]  # 4 full blocks of 8 and 5 tokens
    bm = llm.engine.block_manager
    hits = bm.prefix_hit_tokens
    out = llm.generate([prompt], greedy(5, n=2), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids and len(out.outputs[1].token_ids) == 5
    assert bm.prefix_hit_tokens - hits == 4 * BLOCK_SIZE

    sampled = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True),
                           use_tqdm=False)[0]
    assert len(sampled.outputs) == 3 and all(len(o.token_ids) == 8 for o in sampled.outputs)


def test_aborting_a_choice_that_waits_for_its_first_means_it_never_starts(llm):
    """A sibling (n > 1) waits until its first choice's prompt is cached; aborting it then was
    ignored, and it later ran and sent outputs for a request that had been aborted."""
    engine = llm.engine
    engine.add_request("parent", random_prompts(1, 384, 30, 30, seed=12)[0], greedy(3), fork_ids=["fork-1", "fork-2"])
    assert engine.abort_request("fork-1")
    assert engine.num_waiting == 2  # the first and the other sibling
    seen = set()
    while engine.has_unfinished_requests():
        seen |= {out.request_id for out in engine.step()}
    assert seen == {"parent", "fork-2"}


def test_seeded_n_draws_different_choices_and_repeats_them(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=7, ignore_eos=True)
    first = [c.token_ids for c in llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) > 1  # 12 tokens drawn at temperature 1 from 384: equal only if seeds were


@pytest.mark.parametrize("seed", [2**64 - 1, 2**64 - 2])
def test_n_choices_of_a_seed_at_the_top_of_its_range_wrap_around_and_still_differ(llm, seed):
    """The later choices' seeds (seed + 1, seed + 2) pass the top of the range: they wrap to its
    bottom instead of failing inside the engine's step."""
    params = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=seed, ignore_eos=True)
    choices = [c.token_ids for c in llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs]
    assert len(choices) == 3 and all(len(c) == 12 for c in choices)
    assert len({tuple(c) for c in choices}) > 1
    assert llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)[0].token_ids  # the engine goes on


def test_prompt_longer_than_max_model_len_is_rejected(llm):
    with pytest.raises(ValueError, match="128"):
        llm.generate([[5] * 200], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="128"):
        llm.generate(["word " * 300], greedy(4), use_tqdm=False)


@pytest.mark.parametrize("field, bad", [("stop_token_ids", dict(stop_token_ids=[384], min_tokens=2)),
                                        ("logit_bias", dict(logit_bias={384: 5.0}))])
def test_a_token_id_outside_the_vocabulary_is_refused_before_queueing(llm, field, bad):
    """As the server refuses it (400): the sampler indexes the logits by these ids (with min_tokens
    a stop id is banned by index, and the step failed with an IndexError after the batch was queued)."""
    with pytest.raises(ValueError, match=field):
        llm.generate([[5, 6, 7], [8, 9]], [greedy(4), greedy(4, **bad)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_priorities_need_the_priority_policy_and_leave_greedy_outputs_alone(llm, qwen3_model):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    with pytest.raises(ValueError, match="--scheduling-policy fcfs"):
        llm.generate(prompts, greedy(4), use_tqdm=False, priority=[0, 1, 0])
    with pytest.raises(ValueError, match="3 prompts"):
        llm.generate(prompts, greedy(4), use_tqdm=False, priority=[0, 1])
    assert not llm.engine.has_unfinished_requests()
    by_priority = LLM(qwen3_model, dtype="float32", device="cpu", max_model_len=128, max_num_seqs=1,
                      scheduling_policy="priority")
    ranked = [o.outputs[0].token_ids for o in by_priority.generate(prompts, greedy(4), use_tqdm=False,
                                                                   priority=[3, -1, 2])]
    assert ranked == tokens(llm, prompts, greedy(4))   # outputs keep the prompts' order


def test_a_rejected_batch_leaves_nothing_queued(qwen3_model):
    llm = LLM(qwen3_model, dtype="float32", device="cpu", max_model_len=64)
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], [5] * 100], greedy(4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(tokens(llm, [[8, 9]], greedy(3))[0]) == 3


@pytest.mark.parametrize("bad", [[1, 2.5], [1, "7"], [4, True]])
def test_a_token_id_prompt_holding_a_non_integer_is_refused_and_leaves_the_engine_whole(llm, bad):
    # 2.5 failed in the tokenizer after the batch's first prompt was queued, and every later call failed
    with pytest.raises(ValueError, match="not a token id"):
        llm.generate(["hello", bad], greedy(3), use_tqdm=False)
    assert tokens(llm, [[8, 9]], greedy(3)) == tokens(llm, [np.array([8, 9])], greedy(3))


def test_a_batch_that_fails_while_it_is_queued_leaves_nothing_behind(llm, monkeypatch):
    add_request, calls = llm.engine.add_request, []

    def failing_on_the_second(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("queueing failed")
        return add_request(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", failing_on_the_second)
    with pytest.raises(RuntimeError, match="queueing failed"):
        llm.generate([[5, 6, 7], [8, 9], [10]], greedy(3), use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    assert len(tokens(llm, [[8, 9]], greedy(3))[0]) == 3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_generate_call_that_raises_frees_its_requests_and_the_next_call_works(qwen3_model, async_scheduling):
    """An error or Ctrl-C inside a step leaves nothing of that call in the engine: its blocks were
    held, and the next call failed on the first output of a request it did not know."""
    llm = LLM(qwen3_model, dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_kvcache_blocks=NUM_BLOCKS,
              max_model_len=128, async_scheduling=async_scheduling)
    prompts = random_prompts(3, 384, 10, 30, seed=11)
    expected = tokens(llm, prompts, greedy(6))
    forward, calls = llm.engine.runner.forward, []

    def interrupted_on_the_third_step(work):
        calls.append(work)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return forward(work)

    llm.engine.runner.forward = interrupted_on_the_third_step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy(6), use_tqdm=False)
    assert not llm.engine.sequences
    assert llm.engine.block_manager.num_free_blocks == NUM_BLOCKS
    assert tokens(llm, prompts, greedy(6)) == expected
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_device_defaults_resolve_in_the_config():
    from nanoserve import EngineConfig

    cpu = EngineConfig(device="cpu")
    assert (cpu.async_scheduling, cpu.block_size, cpu.max_num_batched_tokens) == (False, 16, 2048)
    assert EngineConfig(device="cpu", async_scheduling=True).async_scheduling is True


@pytest.mark.parametrize("kwargs, interpret, refusal", [
    (dict(attention_backend="triton", dtype="bfloat16"), "1", "computes bfloat16 wrongly; use --dtype float32"),
    (dict(attention_backend="triton"), "0", "needs a CUDA device, got 'cpu'; use --attention-backend torch"),
    (dict(attention_backend="triton", block_size=8), "1", "block_size >= 16, got 8"),
    (dict(attention_backend="flash_attn"), "1", "'flash_attn' needs a CUDA device"),
])
def test_the_config_refuses_attention_backends_that_cannot_run_here(monkeypatch, kwargs, interpret, refusal):
    """Before any weight loads, not in the engine's process once the model is in memory; triton's
    interpreter on the CPU answered nonsense in bfloat16 rather than failing."""
    from nanoserve import EngineConfig

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    with pytest.raises(ValueError, match=refusal):
        EngineConfig(device="cpu", **kwargs)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineConfig(device="cpu", attention_backend="triton", dtype="float16").attention_backend == "triton"


def test_the_config_refuses_a_block_no_sequence_can_fill():
    from nanoserve import EngineConfig

    with pytest.raises(ValueError, match=r"block_size \(4096\) is more than a sequence of max_model_len "
                                         r"\(2048\) can fill; use a block_size of at most 2048"):
        EngineConfig(device="cpu", block_size=4096)
    assert EngineConfig(device="cpu", block_size=2048, max_model_len=1500).block_size == 2048
    assert EngineConfig(device="cpu", block_size=256, max_model_len=100).block_size == 256


def test_the_config_takes_the_seeds_torch_takes_and_names_the_range_past_them():
    from nanoserve import EngineConfig

    for seed in (-(2**63), -1, 2**64 - 1):
        assert EngineConfig(device="cpu", seed=seed).seed == seed
    for seed in (-(2**63) - 1, 2**64):
        with pytest.raises(ValueError, match=r"seed must be in \[-9223372036854775808, 18446744073709551615\]"):
            EngineConfig(device="cpu", seed=seed)


def test_a_token_budget_under_max_num_seqs_is_refused_with_what_to_change():
    from nanoserve import EngineConfig

    with pytest.raises(ValueError, match="lower --max-num-seqs or raise --max-num-batched-tokens"):
        EngineConfig(device="cpu", max_num_batched_tokens=16)


def test_cache_salt_keeps_prefix_blocks_apart_and_leaves_outputs_alone(llm):
    prompt = [11 + i % 50 for i in range(30)]       # 3 full blocks of 8 before the last token
    bm = llm.engine.block_manager

    def hits(**kw) -> tuple[int, list[int]]:
        before = bm.prefix_hit_tokens
        out = llm.generate([prompt], greedy(4, **kw), use_tqdm=False)[0]
        return bm.prefix_hit_tokens - before, out.token_ids

    first, ref = hits(cache_salt="a")
    assert first == 0
    assert hits(cache_salt="b") == (0, ref)         # another salt finds nothing, computes the same
    assert hits() == (0, ref)
    assert hits(cache_salt="a") == (24, ref)
    assert hits() == (24, ref)


@pytest.mark.parametrize("salt", ["", "x" * 1025, 7])
def test_a_cache_salt_that_is_empty_too_long_or_not_text_is_refused(salt):
    with pytest.raises(ValueError, match="cache_salt must be a string of 1 to 1024 characters"):
        SamplingParams(cache_salt=salt)


@pytest.mark.parametrize("given, taken", [
    (dict(top_k=20.0, n=2.0, max_tokens=8.0, seed=3.0), dict(top_k=20, n=2, max_tokens=8, seed=3)),
    (dict(temperature=1, top_p=1, repetition_penalty=2), dict(temperature=1.0, top_p=1.0, repetition_penalty=2.0)),
    (dict(stop_token_ids=[1.0, 2], logprobs=3.0), dict(stop_token_ids=[1, 2], logprobs=3)),
    (dict(top_k=0), dict(top_k=-1)),   # vLLM's other "off", as the server takes it (was refused offline)
])
def test_sampling_params_hold_the_number_kinds_the_engine_core_decodes(given, taken):
    import msgspec
    import numpy as np

    from nanoserve.engine.messages import AddRequest, input_decoder, input_encoder

    for params in (SamplingParams(**given), SamplingParams(**{k: np.asarray(v)[()] if not isinstance(v, list) else v
                                                             for k, v in given.items()})):
        assert {k: getattr(params, k) for k in taken} == taken
        assert all(type(getattr(params, k)) is type(v) for k, v in taken.items())
        # what the server sends its engine core decodes: a float where an int belongs was dropped there,
        # and the request never ended
        sent = input_decoder.decode(input_encoder.encode(AddRequest(["r"], [[1, 2]], params, [[]])))
        assert isinstance(sent, AddRequest) and msgspec.structs.asdict(sent)["params"] == params


@pytest.mark.parametrize("field, value, message", [
    ("top_k", 2.5, "top_k must be an integer, got 2.5"),
    ("top_k", True, "top_k must be an integer, got True"),
    ("max_tokens", 3.5, "max_tokens must be an integer"),
    ("n", "2", "n must be an integer"),
    ("top_p", True, "top_p must be a number, got True"),
    ("temperature", "0.5", "temperature must be a number"),
    ("logprobs", False, "logprobs must be an integer"),
    ("allowed_token_ids", [1.5], "allowed_token_ids must be an integer, got 1.5"),   # was taken as id 1
    ("allowed_token_ids", [3, True], "allowed_token_ids must be an integer, got True"),
    ("logit_bias", {"5": 1.0}, "logit_bias must be an integer, got '5'"),            # was a TypeError
    ("logit_bias", [5], "logit_bias must map token ids to biases"),
    ("stop", 5, "stop must be a list"),
    ("stop", [5], "stop must be a string or a list of strings"),   # said "cannot contain an empty string"
    ("stop_token_ids", 5, "stop_token_ids must be a list"),
])
def test_sampling_params_refuse_numbers_of_the_wrong_kind(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_a_closed_llm_refuses_new_work_by_name(qwen3_model):
    # close() gives the model and cache back: a later generate is told so, not a NoneType error
    with LLM(qwen3_model, dtype="float32", device="cpu", max_model_len=64) as closed:
        assert len(closed.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)) == 1
    with pytest.raises(RuntimeError, match="closed"):
        closed.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(RuntimeError, match="closed"):
        closed.reset_prefix_cache()
    assert closed.engine.runner.kv_cache is None and closed.engine.runner.model is None
