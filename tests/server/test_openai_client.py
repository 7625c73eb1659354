"""The official `openai` client, sync and async, against a real server: same text as offline generation."""

from __future__ import annotations

import asyncio

import openai
import pytest

from nanoserve import SamplingParams
from tests.server.conftest import openai_client

PROMPTS = ["The function returns", "A list is", "In Python, a class"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a dict?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server.url, timeout=120)


@pytest.fixture(scope="module")
def chat_prompt(offline) -> list[int]:
    text = offline.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    return offline.tokenizer.encode(text, add_special_tokens=False)


def reference(offline, prompt, **kwargs):
    return offline.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)[0]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_streamed_equals_whole_equals_offline(client, offline, prompt):
    ref = reference(offline, prompt, temperature=0.0, max_tokens=24)
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks)
    assert whole.choices[0].text == streamed == ref.text
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert whole.usage.completion_tokens == len(ref.token_ids)
    assert whole.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
    assert whole.model == "tiny" and whole.object == "text_completion"


def test_seeded_sampling_streamed_equals_whole_equals_offline(client, offline):
    ref = reference(offline, PROMPTS[0], temperature=0.9, top_p=0.95, seed=1234, max_tokens=20)
    kwargs = dict(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    whole = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert whole.choices[0].text == streamed == ref.text


def test_chat_streamed_equals_whole_equals_offline(client, offline, chat_prompt):
    ref = reference(offline, chat_prompt, temperature=0.0, max_tokens=24)
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert whole.choices[0].message.content == streamed == ref.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert whole.usage.prompt_tokens == len(chat_prompt)


def test_async_client_concurrent_completions_and_chats(server, offline, chat_prompt):
    refs = [reference(offline, p, temperature=0.0, max_tokens=16).text for p in PROMPTS]
    chat_ref = reference(offline, chat_prompt, temperature=0.0, max_tokens=16).text

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

        async def complete(prompt):
            return (await client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                                    temperature=0)).choices[0].text

        async def complete_streamed(prompt):
            stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                     stream=True)
            return "".join([c.choices[0].text async for c in stream])

        async def chat():
            return (await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16,
                                                         temperature=0)).choices[0].message.content

        async def chat_streamed():
            stream = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=0,
                                                          stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream])

        async with client:
            return await asyncio.gather(*(complete(p) for p in PROMPTS), *(complete_streamed(p) for p in PROMPTS),
                                        chat(), chat_streamed())

    results = asyncio.run(main())
    assert results == refs + refs + [chat_ref, chat_ref]


def test_n_choices_share_the_prompt_blocks(client, server, offline):
    # 60 tokens of prompt: three full 16-token blocks that the siblings must find in the prefix cache
    prompt = offline.tokenizer.decode(offline.tokenizer.encode(" ".join(PROMPTS * 8))[:60])
    prompt_ids = offline.tokenizer.encode(prompt)
    full_blocks = (len(prompt_ids) - 1) // 16
    assert full_blocks >= 3
    before = server.metrics()["nanoserve:prefix_cache_hits_total"]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.8, n=4,
                                    extra_body={"ignore_eos": True})
    hits = server.metrics()["nanoserve:prefix_cache_hits_total"] - before
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == len(prompt_ids)  # the prompt counts once
    assert out.usage.completion_tokens == 4 * 8
    assert hits >= 3 * full_blocks * 16, "siblings recomputed the prompt instead of sharing its blocks"


def test_several_prompts_and_n_come_back_prompt_major(client, offline):
    refs = [reference(offline, p, temperature=0.0, max_tokens=10).text for p in PROMPTS[:2]]
    out = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=10, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [refs[0], refs[0], refs[1], refs[1]]


def test_token_id_prompt_equals_text_prompt(client, offline):
    ids = offline.tokenizer.encode(PROMPTS[1])
    by_text = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_stop_string_cuts_the_text_streamed_and_whole(client, offline):
    ref = reference(offline, PROMPTS[2], temperature=0.0, max_tokens=30, ignore_eos=True).text
    stop = ref[10:13]
    expected = ref[:ref.index(stop)]
    kwargs = dict(model="tiny", prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=[stop, "zzzz"],
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks) == expected
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"


def test_stop_token_is_in_the_token_ids_not_the_text_streamed_and_whole(client, offline):
    """As in vLLM: the EOS or stop_token_id that ended a choice is not written into its text, unless
    include_stop_str_in_output asks for it; it still counts as a completion token."""
    ref = reference(offline, PROMPTS[2], temperature=0.0, max_tokens=12, ignore_eos=True)
    stop_id = ref.token_ids[4]
    cut = ref.token_ids[:ref.token_ids.index(stop_id) + 1]
    kwargs = dict(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0, logprobs=0)
    for include in (False, True):
        extra = {"ignore_eos": True, "stop_token_ids": [stop_id], "include_stop_str_in_output": include}
        expected = offline.tokenizer.decode(cut if include else cut[:-1])
        whole = client.completions.create(**kwargs, extra_body=extra)
        chunks = list(client.completions.create(**kwargs, extra_body=extra, stream=True))
        assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks) == expected
        assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
        assert whole.usage.completion_tokens == len(whole.choices[0].logprobs.tokens) == len(cut)
    # the end-of-text token, shown when special tokens are not skipped, is left out the same way
    eos = offline.tokenizer.eos_token_id
    extra = {"skip_special_tokens": False, "logit_bias": {str(eos): 100}}
    for include in (False, True):
        out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0,
                                             extra_body={**extra, "include_stop_str_in_output": include})
        assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1
        assert out.choices[0].message.content == (offline.tokenizer.decode([eos]) if include else "")


def test_stop_reason_names_the_stop_string_or_token_as_vllm_does(client, offline):
    """vLLM's choice field: the stop string or stop_token_id that ended a choice, None when EOS,
    the length, or nothing yet ended it; streamed chunks carry it with the finish_reason."""
    ref = reference(offline, PROMPTS[2], temperature=0.0, max_tokens=12, ignore_eos=True)
    stop_id, stop_text = ref.token_ids[4], offline.tokenizer.decode(ref.token_ids[6:8])
    assert stop_text
    kwargs = dict(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0)
    for stops, want in (({"stop_token_ids": [stop_id]}, stop_id), ({"stop": [stop_text]}, stop_text), ({}, None)):
        extra = {"ignore_eos": True, **stops}
        whole = client.completions.create(**kwargs, extra_body=extra)
        chunks = list(client.completions.create(**kwargs, extra_body=extra, stream=True))
        assert whole.choices[0].stop_reason == want
        assert whole.choices[0].finish_reason == ("length" if want is None else "stop")
        assert [c.choices[0].stop_reason for c in chunks] == [None] * (len(chunks) - 1) + [want]
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert chat.choices[0].stop_reason in (None, stop_id)
    assert (chat.choices[0].stop_reason == stop_id) == (chat.choices[0].finish_reason == "stop")


def test_logprobs_through_the_client(client):
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(top) in (3, 4) for top in lp.top_logprobs)  # top 3, plus the chosen token if not among them
    # greedy: the chosen token is the most likely one
    assert all(abs(max(top.values()) - chosen) < 1e-5 for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode() == chat.choices[0].message.content


@pytest.mark.parametrize("n", [1, 2])
def test_echo_with_logprobs_scores_the_prompt_streamed_and_whole(client, offline, n):
    """The scoring call of evaluation harnesses: the prompt comes back with its tokens' logprobs."""
    prompt = PROMPTS[1]
    ids = offline.tokenizer.encode(prompt)
    ref = reference(offline, prompt, temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=2)
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                      echo=True, n=n)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                            echo=True, n=n, stream=True))
    for choice in range(n):
        lp = whole.choices[choice].logprobs
        assert whole.choices[choice].text == prompt + ref.text
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids) + 3
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = ([entry[0] for entry in ref.outputs[0].prompt_logprobs.entries()[1:]]
                    + [entry[t].logprob for t, entry in zip(ref.token_ids, ref.outputs[0].logprobs)])
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
        assert lp.text_offset[0] == 0 and "".join(lp.tokens).endswith(ref.text)
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice]
        assert "".join(c.text for c in mine) == whole.choices[choice].text
        assert sum((c.logprobs.token_logprobs for c in mine if c.logprobs), []) == lp.token_logprobs
        assert sum((c.logprobs.text_offset for c in mine if c.logprobs), []) == lp.text_offset


def test_echo_with_max_tokens_0_returns_the_prompt_alone_with_its_logprobs(client, offline):
    """How scoring harnesses ask for a prompt's logprobs (vLLM accepts it): nothing generated comes back."""
    prompt = PROMPTS[2]
    ids = offline.tokenizer.encode(prompt)
    ref = reference(offline, prompt, temperature=0.0, max_tokens=1, logprobs=2, prompt_logprobs=2)
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    whole = client.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [entry[0] for entry in ref.outputs[0].prompt_logprobs.entries()[1:]], abs=1e-5)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 0)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    mine = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in mine) == prompt and mine[-1].finish_reason == "length"
    assert sum((c.logprobs.token_logprobs for c in mine if c.logprobs), []) == choice.logprobs.token_logprobs
    assert chunks[-1].usage.completion_tokens == 0
    assert client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True).choices[0].text == prompt
    with pytest.raises(openai.BadRequestError, match="0 is allowed with echo"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, offline, chat_prompt):
    """vLLM's flag: tokens of equal or partial text are told apart; offsets still count the text."""
    prompt = PROMPTS[0]
    ref = reference(offline, prompt, temperature=0.0, max_tokens=6, logprobs=2)
    names = [f"token_id:{t}" for t in ref.token_ids]
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    plain = client.completions.create(**kwargs).choices[0].logprobs
    whole = client.completions.create(**kwargs, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"return_tokens_as_token_ids": True}))
    assert whole.text == ref.text and whole.logprobs.tokens == names
    assert sum((c.choices[0].logprobs.tokens for c in chunks if c.choices[0].logprobs), []) == names
    assert whole.logprobs.text_offset == plain.text_offset
    for top, name, entry in zip(whole.logprobs.top_logprobs, names, ref.outputs[0].logprobs):
        assert set(top) == {f"token_id:{t}" for t in entry} | {name}
    chat_ref = reference(offline, chat_prompt, temperature=0.0, max_tokens=4, logprobs=2)
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat_ref.token_ids]
    assert all(bytes(c.bytes) == c.token.encode() for c in content)
    assert [[t.token for t in c.top_logprobs] for c in content] == \
        [[f"token_id:{t}" for t, lp in sorted(entry.items(), key=lambda item: item[1].rank)[:2]]
         for entry in chat_ref.outputs[0].logprobs]


def test_truncate_prompt_tokens_keeps_the_prompt_end(client, offline):
    ids = offline.tokenizer.encode(PROMPTS[2])
    ref = reference(offline, ids[-3:], temperature=0.0, max_tokens=8)
    out = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 3})
    assert out.usage.prompt_tokens == 3
    assert out.choices[0].text == offline.tokenizer.decode(ids[-3:]) + ref.text
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


def test_continuous_usage_stats_count_up_in_every_chunk(client):
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens == 12
    assert len(set(c.usage.prompt_tokens for c in chunks)) == 1
    chat = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chat)   # the opening role chunk too, as vLLM sends it
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    # the prompt's cached tokens are the same in every chunk: the opening one waited to know them
    long = [{"role": "user", "content": "Tell me about the weather in the towns along the river, one by one, please"}]
    for _ in range(2):   # the second finds the first's full blocks in the prefix cache
        again = list(client.chat.completions.create(
            model="tiny", messages=long, max_tokens=4, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    cached = {c.usage.prompt_tokens_details.cached_tokens for c in again}
    assert len(cached) == 1 and cached.pop() > 0


def test_models_list_and_errors_reach_the_client(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=-1)


def test_an_empty_model_name_asks_for_the_served_model_as_in_vllm(client):
    # "" was a 404 "The model '' does not exist"; vLLM serves its model to a request that names none
    completion = client.completions.create(model="", prompt="x", max_tokens=2)
    chat = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    streamed = list(client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=2, stream=True))
    assert completion.model == chat.model == streamed[0].model == "tiny"
    assert completion.usage.completion_tokens == chat.usage.completion_tokens == 2
    response = client.responses.create(model="", input="Hi", max_output_tokens=2)
    assert response.model == "tiny" and response.status == "incomplete"


def test_offline_chat_equals_the_servers_chat_completion(client, offline):
    # LLM.chat, as vLLM's: the conversation as the chat template writes it, whole or continued
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0)
    ref = offline.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0]
    assert ref.text == whole.choices[0].message.content and len(ref.prompt_token_ids) == whole.usage.prompt_tokens
    started = [*CHAT, {"role": "assistant", "content": "A dict maps"}]
    cont = client.chat.completions.create(model="tiny", messages=started, max_tokens=12, temperature=0,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    continued = offline.chat(started, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False,
                             add_generation_prompt=False, continue_final_message=True)[0]
    assert continued.text == cont.choices[0].message.content
    several = offline.chat([CHAT[1:], CHAT], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    assert len(several) == 2 and several[1].text == ref.text and several[0].prompt_token_ids != ref.prompt_token_ids
    with pytest.raises(ValueError, match="continue_final_message continues the last message"):
        offline.chat(started, continue_final_message=True)
