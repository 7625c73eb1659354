"""AsyncEngine: one engine core serving many asyncio consumers, with aborts, stops and failures.

The core runs on a thread here (the same loop and messages as the engine process, without the
cost of a process per test); tests/server run it as the process `serve` starts."""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import time

import pytest

from nanoserve import LLM, EngineConfig, SamplingParams
from nanoserve.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream, exit_reason
from nanoserve.engine.llm_engine import LLMEngine
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(model: str, **kwargs) -> AsyncEngine:
    max_queue_len = kwargs.pop("max_queue_len", None)
    config = EngineConfig(model=model, device="cpu", dtype="float32", **kwargs)
    return AsyncEngine(config, max_queue_len, engine=LLMEngine(config))


async def drain(stream: RequestStream) -> list[list[int]]:
    async for _ in stream:
        pass
    return [out.token_ids for out in stream.outputs]


async def wait_idle(engine: AsyncEngine, timeout: float = 30.0) -> None:
    """Until the engine thread has published a snapshot with nothing running or holding blocks."""
    for _ in range(int(timeout / 0.02)):
        s = engine.stats
        if s.num_running == 0 and s.num_waiting == 0 and s.blocks_in_use == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine still busy: {engine.stats}")


@pytest.fixture(scope="module")
def offline(qwen3_model) -> LLM:
    return LLM(qwen3_model, device="cpu", dtype="float32")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "pipelined"])
def test_concurrent_requests_equal_offline_generate(qwen3_model, offline, async_scheduling):
    prompts = random_prompts(6, 384, 3, 40, seed=11)
    lengths = [3, 12, 7, 1, 9, 5]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    expected = [o.token_ids for o in offline.generate(prompts, params, use_tqdm=False)]

    async def main():
        engine = make_engine(qwen3_model, async_scheduling=async_scheduling)
        await engine.start()
        try:
            streams = [engine.add_request(f"r{i}", [p], sp) for i, (p, sp) in enumerate(zip(prompts, params))]
            results = await asyncio.gather(*(drain(s) for s in streams))
            await wait_idle(engine)
            return [r[0] for r in results]
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == expected


def test_prompts_and_choices_are_indexed_prompt_major_and_siblings_share_the_prompt(qwen3_model, offline):
    prompts = random_prompts(2, 384, 40, 40, seed=12)  # 40 tokens: two full blocks of 16 to share
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=3)
    single = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate(prompts, single, use_tqdm=False)]

    async def main():
        engine = make_engine(qwen3_model, block_size=16)
        await engine.start()
        try:
            stream = engine.add_request("multi", prompts, params)
            indices = set()
            async for update in stream:
                indices.add(update.index)
                assert update.num_prompt_tokens == 40
            await wait_idle(engine)
            return indices, [o.token_ids for o in stream.outputs], engine.stats
        finally:
            await engine.shutdown()

    indices, outputs, stats = asyncio.run(main())
    assert indices == set(range(6))
    assert outputs == [expected[0]] * 3 + [expected[1]] * 3
    # each of the 2 siblings per prompt found the prompt's 2 full blocks in the cache: no second prefill
    assert stats.prefix_hit_tokens >= 2 * 2 * 32


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "pipelined"])
def test_closing_a_stream_aborts_at_once_and_frees_every_block(qwen3_model, async_scheduling):
    async def main():
        engine = make_engine(qwen3_model, async_scheduling=async_scheduling)
        await engine.start()
        try:
            long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True, n=2)
            stream = engine.add_request("gone", random_prompts(1, 384, 30, 30, seed=13), long)
            seen = 0
            async for update in stream:
                seen += len(update.token_ids)
                if seen >= 4:
                    break
            stream.close()  # what the server does when the client disconnects
            await wait_idle(engine, timeout=10)
            assert all(len(o.token_ids) < 300 for o in stream.outputs)
            # and it keeps serving
            follow = engine.add_request("next", [[5, 6, 7]], GREEDY)
            assert len((await drain(follow))[0]) == GREEDY.max_tokens
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_stop_string_aborts_the_engine_request(qwen3_model, offline):
    prompt = random_prompts(1, 384, 10, 10, seed=14)[0]
    full = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                            use_tqdm=False)[0].text
    stop = full[len(full) // 3:len(full) // 3 + 3]
    assert len(stop) == 3 and stop.strip()

    async def main():
        engine = make_engine(qwen3_model)
        await engine.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
            stream = engine.add_request("stop", [prompt], params)
            updates = [u async for u in stream]
            await wait_idle(engine)
            return updates, stream.outputs[0]
        finally:
            await engine.shutdown()

    updates, out = asyncio.run(main())
    assert out.text == full[:full.index(stop)]
    assert "".join(u.text for u in updates) == out.text
    assert updates[-1].finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 40  # aborted when the stop string showed up, not run to max_tokens


def test_queue_limit_refuses_without_queueing(qwen3_model):
    async def main():
        engine = make_engine(qwen3_model, max_num_seqs=1, max_queue_len=2)
        await engine.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
            streams = [engine.add_request("q0", [[3, 4, 5]], params)]
            while engine.stats.num_running == 0:
                await asyncio.sleep(0.01)
            # q0 runs (max_num_seqs=1); the next two wait; the fourth finds the queue full
            streams += [engine.add_request(f"q{i}", [[3, 4, 5]], params) for i in (1, 2)]
            with pytest.raises(QueueFullError, match="max_queue_len 2"):
                engine.add_request("q3", [[3, 4, 5]], params)
            results = await asyncio.gather(*(drain(s) for s in streams))
            assert all(len(r[0]) == 30 for r in results)
            await wait_idle(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_request_the_core_cannot_receive_is_refused_and_holds_no_place(qwen3_model):
    """Something past msgspec's 64-bit integers (here forced past validation) must not leave the
    request's streams registered: each such request would keep a place in the queue for good."""
    async def main():
        engine = make_engine(qwen3_model, max_num_seqs=1, max_queue_len=1)
        await engine.start()
        try:
            bad = SamplingParams(temperature=0.0, max_tokens=4)
            bad.seed = 2**70
            for i in range(4):   # more than max_num_seqs + max_queue_len
                with pytest.raises(ValueError, match="cannot be passed to the engine"):
                    engine.add_request(f"bad{i}", [[3, 4, 5]], bad)
            assert engine.num_unfinished == 0
            assert len((await drain(engine.add_request("good", [[3, 4, 5]], GREEDY)))[0]) == 12
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_requests_prompts_reach_the_core_in_one_message_with_one_params(qwen3_model):
    """Params sent per prompt were decoded and validated once per prompt: a batch of 256 prompts
    with a logit_bias over a 150k vocabulary took 20 s of the core's loop and 400 MB of messages."""
    async def main():
        engine = make_engine(qwen3_model)
        received = []
        add = engine._engine.add_request
        engine._engine.add_request = lambda rid, prompt, params, forks=(), priority=0: received.append(params) or add(
            rid, prompt, params, forks, priority)
        await engine.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, n=2, logit_bias={5: 1.0})
            out = await drain(engine.add_request("batch", [[3, 4, 5], [6, 7], [8]], params))
            assert [len(o) for o in out] == [3] * 6
            assert len(received) == 3 and all(p is received[0] for p in received)
            await wait_idle(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_schema_with_integers_past_64_bits_reaches_the_grammar_compiler():
    from nanoserve.structured_outputs_params import StructuredOutputsParams

    spec = StructuredOutputsParams(json={"type": "string", "x-big": 10**30, "maxLength": 3})
    assert spec.json == '{"type": "string", "x-big": 1000000000000000000000000000000, "maxLength": 3}'
    other_order = StructuredOutputsParams(json={"maxLength": 3, "type": "string", "x-big": 10**30})
    assert spec.key != other_order.key   # property order shapes the grammar: not one cache entry


def test_bad_prompt_is_refused_before_queueing(qwen3_model):
    async def main():
        engine = make_engine(qwen3_model, max_model_len=64)
        await engine.start()
        try:
            with pytest.raises(ValueError, match="64 tokens.*60 in the prompt and 10"):
                engine.add_request("long", [[1] * 60], SamplingParams(max_tokens=10))
            with pytest.raises(ValueError, match="empty"):
                engine.add_request("empty", [[]], SamplingParams())
            assert engine.stats.num_waiting == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_an_engine_failure_fails_requests_in_flight_and_marks_it_unhealthy(qwen3_model):
    async def main():
        config = EngineConfig(model=qwen3_model, device="cpu", dtype="float32")
        core = LLMEngine(config)
        engine = AsyncEngine(config, engine=core)
        real_step, calls = core.step, []

        def failing_step():
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("simulated device fault")
            return real_step()

        core.step = failing_step
        await engine.start()
        try:
            stream = engine.add_request("doomed", [[3, 4, 5]], SamplingParams(max_tokens=50, ignore_eos=True))
            # the cause goes to the log; the client hears that the engine is gone, not its internals
            with pytest.raises(EngineDeadError, match="stopped unexpectedly"):
                await asyncio.wait_for(drain(stream), timeout=10)
            assert not engine.healthy
            with pytest.raises(EngineDeadError):
                engine.add_request("after", [[3]], SamplingParams())
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_slow_reader_gets_fewer_merged_updates_with_the_same_text_and_logprobs(qwen3_model):
    prompt = random_prompts(1, 384, 12, 12, seed=15)[0]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=2)

    async def read(engine: AsyncEngine, request_id: str, pause: float) -> list:
        updates = []
        async for update in engine.add_request(request_id, [prompt], params):
            updates.append(update)
            await asyncio.sleep(pause)  # a client that reads slower than tokens arrive
        return updates

    async def main():
        engine = make_engine(qwen3_model)
        await engine.start()
        try:
            fast = await read(engine, "fast", 0.0)
            slow = await read(engine, "slow", 0.05)
            await wait_idle(engine)
            return fast, slow
        finally:
            await engine.shutdown()

    fast, slow = asyncio.run(main())
    assert len(slow) < len(fast) / 2  # merged, not queued one per step
    for updates in (fast, slow):
        assert sum(len(u.token_ids) for u in updates) == 60
        assert [u.finish_reason for u in updates][-1] == "length"
        assert all(u.finish_reason is None for u in updates[:-1])
    assert "".join(u.text for u in slow) == "".join(u.text for u in fast)
    assert [t for u in slow for t in u.token_ids] == [t for u in fast for t in u.token_ids]
    assert [lp for u in slow for lp in u.logprobs] == [lp for u in fast for lp in u.logprobs]


def _exit_with(code: int) -> None:
    raise SystemExit(code)


def _sleep_forever() -> None:
    time.sleep(600)


def test_the_log_says_how_the_engine_process_ended() -> None:
    context = multiprocessing.get_context("fork")
    exits = context.Process(target=_exit_with, args=(3,))
    exits.start()
    exits.join(30)
    assert exit_reason(exits) == "exited with code 3"
    killed = context.Process(target=_sleep_forever)
    killed.start()
    killed.kill()
    assert exit_reason(killed, wait_s=30) == "was killed by SIGKILL"
    running = context.Process(target=_sleep_forever)
    running.start()
    try:
        assert exit_reason(running, wait_s=0.05) == "closed its pipe and is still running after 0.05 s"
    finally:
        running.terminate()
    assert exit_reason(running, wait_s=30) == f"was killed by {signal.Signals.SIGTERM.name}"


@pytest.mark.parametrize("window", [None, 16])
def test_the_ready_line_says_how_many_sequences_of_max_model_len_the_cache_holds(tmp_path, caplog, window):
    # vLLM's "maximum concurrency": 24 blocks of 16 hold 3 sequences of 128 tokens; under a 16-key window
    # one holds its window and a 32-token chunk, 4 blocks, so the same cache holds 6
    from tests.conftest import _random_model
    folder = _random_model(tmp_path / "model", "mistral", sliding_window=window)

    async def main():
        engine = make_engine(folder, block_size=16, num_kvcache_blocks=24, max_model_len=128,
                             max_num_batched_tokens=32, max_num_seqs=4)
        with caplog.at_level("INFO", logger="nanoserve.engine.async_engine"):
            await engine.start()
        await engine.shutdown()

    asyncio.run(main())
    expected = {None: "3.0", 16: "6.0"}[window]
    assert f"384 tokens; {expected} sequences of max_model_len 128 at once" in caplog.text
