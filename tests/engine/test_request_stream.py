"""A request's stream on the front end: what it holds for a reader that lags, and what a stream keeps at all."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from nanoserve.engine.outputs import RequestState, StepOutput
from nanoserve.engine.request_stream import RequestStream, output_bytes_per_token
from nanoserve.sampling_params import SamplingParams
from tests.conftest import _save_tokenizer

TEXT = "A list is a mutable sequence, and a tuple is an immutable one."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte-level-tokenizer")
    _save_tokenizer(str(folder))
    return AutoTokenizer.from_pretrained(folder)


def stream_of(tokenizer, params: SamplingParams, keep: bool) -> tuple[RequestStream, list[str]]:
    aborted: list[str] = []
    state = RequestState(tokenizer, [1, 2], params, keep=keep)
    return RequestStream(["r"], [state], aborted.extend), aborted


def step(token: int, finished: bool, top_n: int | None) -> StepOutput:
    logprobs = None if top_n is None else [(-0.5, [(token, -0.5)] * top_n)]
    return StepOutput("r", [token], logprobs, finished, "length" if finished else None, 2, 0)


async def read_all(stream: RequestStream) -> list:
    return [update async for update in stream]


def test_a_lagging_reader_gets_one_merged_update_and_its_backlog_is_counted_until_read(tokenizer):
    params = SamplingParams(max_tokens=64, logprobs=5)
    stream, _ = stream_of(tokenizer, params, keep=False)
    ids = tokenizer.encode(TEXT)
    for i, token in enumerate(ids):
        stream.on_step(step(token, i == len(ids) - 1, 5))
    assert stream.pending_bytes >= len(ids) * output_bytes_per_token(params)
    (update,) = asyncio.run(read_all(stream))
    assert update.text == TEXT and update.token_ids == ids and len(update.logprobs) == len(ids)
    assert stream.pending_bytes == 0


def test_a_streamed_request_keeps_counts_not_its_sent_text_tokens_or_logprobs(tokenizer):
    ids = tokenizer.encode(TEXT)
    streamed, _ = stream_of(tokenizer, SamplingParams(max_tokens=64, logprobs=20), keep=False)
    whole, _ = stream_of(tokenizer, SamplingParams(max_tokens=64, logprobs=20), keep=True)
    for s in (streamed, whole):
        for i, token in enumerate(ids):
            s.on_step(step(token, i == len(ids) - 1, 20))
        asyncio.run(read_all(s))
    out = streamed.outputs[0]
    assert (out.text, out.token_ids, out.logprobs, out.num_tokens) == ("", [], [], len(ids))
    assert streamed.kept_bytes == 0   # no prompt logprobs were asked for
    out = whole.outputs[0]
    assert (out.text, out.token_ids, len(out.logprobs), out.num_tokens) == (TEXT, ids, len(ids), len(ids))
    assert whole.kept_bytes > 0


def test_dropping_a_backlog_and_failing_the_stream_aborts_what_still_runs(tokenizer):
    stream, aborted = stream_of(tokenizer, SamplingParams(max_tokens=64), keep=False)
    for token in tokenizer.encode(TEXT)[:5]:
        stream.on_step(step(token, False, None))
    stream.drop_pending()
    stream.fail(RuntimeError("too slow"))
    stream.close()
    assert stream.pending_bytes == 0 and aborted == ["r"] and stream.engine_done
    with pytest.raises(RuntimeError, match="too slow"):
        asyncio.run(read_all(stream))


@pytest.mark.parametrize("interval", [1, 4])
def test_a_reader_gets_the_first_token_alone_then_an_update_per_interval(tokenizer, interval):
    ids = tokenizer.encode(TEXT)
    assert len(ids) > 3 * interval + 1

    async def keep_up() -> list:
        stream = RequestStream(["r"], [RequestState(tokenizer, [1, 2], SamplingParams(max_tokens=64), keep=False)],
                               lambda ids: None, interval)
        async def read_slowly() -> list:   # each update takes the reader a while to send
            updates = []
            async for update in stream:
                updates.append(update)
                for _ in range(3):
                    await asyncio.sleep(0)
            return updates

        reader = asyncio.ensure_future(read_slowly())
        for i, token in enumerate(ids):
            stream.on_step(step(token, i == len(ids) - 1, None))
            await asyncio.sleep(0)   # the reader runs between steps, as the front end's loop lets it
            await asyncio.sleep(0)
        return await reader

    updates = asyncio.run(keep_up())
    sizes = [len(u.token_ids) for u in updates]
    assert sum(sizes) == len(ids) and "".join(u.text for u in updates) == TEXT
    assert sizes[0] == 1   # the first token is never held: the time to it is the TTFT
    # a reader busy sending gets what came meanwhile merged, never an update of fewer tokens
    assert all(size >= interval for size in sizes[1:-1]) and len(updates) <= 2 + len(ids) // interval
    assert updates[-1].finish_reason == "length"
