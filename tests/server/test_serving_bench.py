"""bench/serving.py against a real server: every request completes with exactly the tokens it asked for,
from one client process or several, and a failed request fails the run."""

from __future__ import annotations

import asyncio

import pytest

from nanoserve.benchmarks.serving import parse_args, report, run_benchmark


def test_serving_benchmark_counts_every_token(server):
    args = parse_args(["--url", server.url, "--num-requests", "12", "--request-rate", "40", "--max-concurrency", "8",
                       "--min-input-len", "5", "--max-input-len", "40", "--min-output-len", "2",
                       "--max-output-len", "12", "--max-token-id", "300"])
    stats = asyncio.run(run_benchmark(args))
    assert stats["failed"] == 0, stats["errors"]
    assert stats["requests"] == 12 and len(stats["latency"]) == 12
    assert stats["output_tokens"] == stats["expected_tokens"] >= 24  # ignore_eos: each gets its max_tokens
    assert all(0 < t <= e for t, e in zip(stats["ttft"], stats["latency"]))
    assert len(stats["tpot"]) == 12 and all(t > 0 for t in stats["tpot"])
    text = report(stats, args.request_rate)
    assert text.startswith(f"serving: 12 requests (0 failed), {stats['output_tokens']} output tokens")
    server.wait_idle()


def test_serving_benchmark_reports_rejected_requests(server):
    # ids past the vocabulary are refused with 400: the benchmark counts them as failed and goes on
    args = parse_args(["--url", server.url, "--num-requests", "3", "--min-input-len", "3", "--max-input-len", "3",
                       "--min-output-len", "2", "--max-output-len", "2", "--max-token-id", "10000000"])
    stats = asyncio.run(run_benchmark(args))
    assert stats["failed"] == 3 and stats["output_tokens"] == 0
    assert "HTTP 400" in stats["errors"][0]


def test_serving_benchmark_spreads_the_load_over_client_processes_and_exits_non_zero_on_failure(server, capsys):
    from nanoserve.benchmarks.serving import main

    common = ["--url", server.url, "--num-requests", "6", "--min-input-len", "3", "--max-input-len", "9",
              "--min-output-len", "2", "--max-output-len", "6"]
    main([*common, "--num-clients", "3"])  # the defaults' prompt ids fit the bundled model's vocabulary
    out = capsys.readouterr().out
    assert out.startswith("serving: 6 requests (0 failed)") and "client: 3 process(es)" in out
    with pytest.raises(SystemExit) as exit_:
        main([*common, "--max-token-id", "10000000"])
    assert exit_.value.code == 1
