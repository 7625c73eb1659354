"""`--scheduling-policy priority`: vLLM's `priority` field orders requests, lower first, and a
request of a higher priority takes the place of a running one of a lower priority."""

from __future__ import annotations

import threading
import time

import openai

from nanoserve.sampling_params import MAX_INT
from tests.server.conftest import ServerProcess, openai_client


def test_a_higher_priority_request_overtakes_a_running_stream_which_then_completes_unchanged(server_model, tmp_path):
    # one seat: the urgent request can only run if the running stream gives up its place
    with ServerProcess(server_model, tmp_path, "--scheduling-policy", "priority", "--max-num-seqs", "1",
                       "--num-kvcache-blocks", "512", "--block-size", "16") as server:
        client = openai_client(server.url)
        long_body = dict(model="tiny", prompt="A long story about the sea", max_tokens=300, temperature=0.0,
                         extra_body={"ignore_eos": True, "priority": 10})
        alone = client.completions.create(**long_body).choices[0].text

        streamed: list[str] = []
        urgent_done_after_chunks: list[int] = []
        first_chunk = threading.Event()

        def stream_low() -> None:
            for chunk in client.completions.create(**long_body, stream=True):
                streamed.append(chunk.choices[0].text if chunk.choices else "")
                first_chunk.set()

        low = threading.Thread(target=stream_low)
        low.start()
        assert first_chunk.wait(60)
        start = time.monotonic()
        urgent = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Quick!"}],
                                                max_tokens=5, temperature=0.0,
                                                extra_body={"ignore_eos": True, "priority": -5})
        urgent_done_after_chunks.append(len(streamed))
        urgent_seconds = time.monotonic() - start
        low.join(120)
        assert not low.is_alive()

        assert urgent.usage.completion_tokens == 5 and urgent.choices[0].finish_reason == "length"
        # it ran while the stream was paused, not after it: the stream had most of its tokens to go
        assert urgent_done_after_chunks[0] < 200, (urgent_done_after_chunks, urgent_seconds)
        assert server.metrics()["nanoserve:num_preemptions_total"] >= 1
        # preempted and recomputed, the stream's greedy text is the one it has alone
        assert "".join(streamed) == alone
        server.wait_idle()

        # /v1/responses takes the field too
        done = client.responses.create(model="tiny", input="Hello", max_output_tokens=3,
                                       extra_body={"priority": 3})
        assert done.status in ("completed", "incomplete")


def test_priority_bounds_and_the_first_come_first_served_refusal(server, server_model, tmp_path):
    client = openai_client(server.url)   # the shared server: first come, first served
    try:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body={"priority": 1})
        raise AssertionError("a priority was taken under first come, first served")
    except openai.BadRequestError as exc:
        assert exc.body["param"] == "priority" and "--scheduling-policy" in exc.body["message"]
    with ServerProcess(server_model, tmp_path, "--scheduling-policy", "priority") as prio:
        client = openai_client(prio.url)
        for value in (-MAX_INT - 1, MAX_INT):   # the field's bounds
            done = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body={"priority": value})
            assert done.usage.completion_tokens == 2
        for value in (MAX_INT + 1, -MAX_INT - 2, 2**64, 1.5, "high"):
            try:
                client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body={"priority": value})
                raise AssertionError(f"priority {value!r} was taken")
            except openai.BadRequestError as exc:
                assert "priority" in str(exc.body), exc.body
        prio.wait_idle()
