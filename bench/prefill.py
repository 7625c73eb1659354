"""Time to first token of one prompt alone, against its compute floor, at 1k, 4k and 16k tokens.

    python bench/prefill.py --config bench/configs/qwen3-0.6b.json [--lengths 1024,4096,16384]

A prompt of N random ids goes through the offline engine alone, with max_tokens 1 (its chunks of
max_num_batched_tokens, the forward passes, the one sample); median of --repeats after a
warm-up of the same length, so compiles stay out. The floor is the step's matmul work, 2 FLOPs
per weight per token plus causal attention (QK^T and PV, half of N x N per head), at the bf16
matmul rate measured in the same run (a large square GEMM). Weights and KV traffic are ignored:
at these lengths a prefill is compute-bound.

`--cached N` puts the same N tokens, found in the prefix cache, ahead of every prompt (a
conversation's next turn); `--beside K` then times the step that admits each turn beside K
decoding streams, with the prefill graphs' key splits allowed and refused.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from random import Random

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanoserve import SamplingParams  # noqa: E402
from nanoserve.benchmarks.config_file import config_from_file  # noqa: E402
from nanoserve.benchmarks.gpu_profile import print_gpu_profile  # noqa: E402
from nanoserve.engine.llm import LLM  # noqa: E402
from nanoserve.runner.models.decoder import head_dim_of  # noqa: E402


def matmul_flops_per_second(size: int = 8192) -> float:
    """bf16 FLOP/s of a large square GEMM: what a compute-bound prefill can hope for."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * size ** 3 * 20 / (start.elapsed_time(end) / 1e3)


def prefill_flops(hf, tokens: int, history: int = 0) -> float:
    """Matmul FLOPs of one causal prefill of `tokens` tokens after `history` cached ones (LM head
    on the last token only)."""
    d, layers = hf.hidden_size, hf.num_hidden_layers
    head_dim = head_dim_of(hf)
    q, kv = hf.num_attention_heads * head_dim, hf.num_key_value_heads * head_dim
    per_layer_weights = d * (q + 2 * kv) + q * d + 3 * d * hf.intermediate_size
    linear = 2 * tokens * per_layer_weights * layers + 2 * d * hf.vocab_size
    # QK^T and PV over the causal half: 2 matmuls x 2 FLOPs x N^2 / 2 x head_dim per q head
    attention = 2 * tokens * (tokens + 2 * history) * head_dim * hf.num_attention_heads * layers
    return linear + attention


def print_host_split(llm: LLM, fn, calls: int = 30) -> None:
    """Host microseconds per call of fn spent staging a prefill graph's inputs and inside its
    launch call (CUDAGraph.replay); the device is idle in both when the prompt arrives alone."""
    graphs = llm.engine.runner.prefill_graphs
    if graphs is None:
        print("  no prefill graphs")
        return
    spent = {"stage": 0.0, "launch": 0.0}
    replay, run = torch.cuda.CUDAGraph.replay, type(graphs).run

    def timed_replay(graph):
        start = time.perf_counter()
        replay(graph)
        spent["launch"] += time.perf_counter() - start

    def timed_run(self, *a, **kw):
        start, launched = time.perf_counter(), spent["launch"]
        out = run(self, *a, **kw)
        spent["stage"] += time.perf_counter() - start - (spent["launch"] - launched)
        return out

    torch.cuda.CUDAGraph.replay, type(graphs).run = timed_replay, timed_run
    try:
        for _ in range(calls):
            fn()
    finally:
        torch.cuda.CUDAGraph.replay, type(graphs).run = replay, run
    print(f"  host per prefill: staging {1e6 * spent['stage'] / calls:.0f} us, graph launch call "
          f"{1e6 * spent['launch'] / calls:.0f} us")


def print_turns_beside_streams(llm: LLM, lengths: list[int], history: list[int],
                               random_ids: Callable[[int], list[int]], streams: int, repeats: int) -> None:
    """The step that admits a turn of n new tokens after `history` (in the cache) beside `streams`
    sequences each decoding at context 1k: its time through ModelRunner.run (graph replay, LM head,
    sampling, the sync), median of `repeats`, with the prefill graphs' key splits allowed and with
    them refused. The runner is driven directly, over blocks of its own: the engine's prefix cache
    is overwritten, so nothing may generate after this."""
    from nanoserve.runner.batch import SequenceWork

    runner = llm.engine.runner
    graphs, bs = runner.prefill_graphs, runner.block_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    next_block = 0

    def blocks(tokens: int) -> list[int]:
        nonlocal next_block
        first, next_block = next_block, next_block - (-tokens // bs)
        return list(range(first, next_block))

    decoding = []
    for _ in range(streams):   # each stream's 1,024 tokens in the cache, then its next token to decode
        ids = random_ids(1025)
        decoding.append(SequenceWork(ids, 1025, 1024, 1, blocks(1025), params))
        runner.run([SequenceWork(ids, 1025, 0, 1024, decoding[-1].block_table, None)])
    print(f"the step admitting a turn after {len(history)} cached tokens beside {streams} decoding streams "
          f"(context 1k), ms")
    print(f"{'tokens':>7} {'split allowed':>14} {'never split':>12}")
    split_sizes = graphs.split_sizes if graphs is not None else set()
    for n in lengths:
        ids = history + random_ids(n)
        table = blocks(len(ids))
        runner.run([SequenceWork(ids, len(ids), 0, len(history), table, None)])
        step = decoding + [SequenceWork(ids, len(ids), len(history), n, table, params)]
        row = []
        for allowed in (split_sizes, set()):
            if graphs is not None:
                graphs.split_sizes = allowed
            runner.run(step)   # warm-up
            times = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                start = time.perf_counter()
                runner.run(step)
                times.append(time.perf_counter() - start)
            row.append(statistics.median(times) * 1e3)
        if graphs is not None:
            graphs.split_sizes = split_sizes
        print(f"{n:>7} {row[0]:>14.2f} {row[1]:>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="bench/configs/qwen3-0.6b.json")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-num-seqs", type=int, default=1,
                        help="the engine's max_num_seqs: the prefill graphs are sized for that many sequences")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--prefill-cuda-graphs", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="also print GPU ops, busy time, span and the longest idle gaps per prefill (torch.profiler)")
    parser.add_argument("--trace", metavar="DIR", help="with --profile: a Chrome trace per length in DIR")
    parser.add_argument("--cached", type=int, default=0, metavar="N",
                        help="every prompt follows the same N tokens, in the prefix cache: each length is the new "
                             "tokens a turn of a conversation adds")
    parser.add_argument("--beside", type=int, default=0, metavar="K",
                        help="then time the step that admits each turn (after --cached tokens) beside K streams "
                             "decoding at context 1k, with the prefill key splits allowed and refused")
    parser.add_argument("--host", action="store_true",
                        help="also print the host's time per prefill: staging the graph's inputs, the graph launch call")
    args = parser.parse_args()
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    lengths = [int(n) for n in args.lengths.split(",")]
    config = config_from_file(args.config, max_model_len=max(args.cached + max(lengths) + 1, 1025),
                              max_num_seqs=max(args.max_num_seqs, args.beside + 1),
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.attention_backend,
                              prefill_cuda_graphs=args.prefill_cuda_graphs, enable_prefix_caching=args.cached > 0)
    llm = LLM(config=config)
    hf = config.hf_config
    rate = matmul_flops_per_second()
    rng = Random(0)
    random_ids = lambda n: [rng.randrange(10000) for _ in range(n)]   # noqa: E731
    history = random_ids(args.cached)
    fresh = lambda n: history + random_ids(n)   # noqa: E731
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    print(f"bf16 GEMM rate {rate / 1e12:.0f} TFLOP/s, {os.path.basename(args.config)}, "
          f"chunks of {args.max_num_batched_tokens}, backend {llm.engine.runner.backend.name}, kv {config.kv_cache_dtype}, "
          f"prefill graphs {'on' if llm.engine.runner.prefill_graphs is not None else 'off'}"
          + (f", after {args.cached} cached tokens" if args.cached else ""))
    print(f"{'tokens':>7} {'TTFT ms':>9} {'floor ms':>9} {'TTFT / floor':>13}")
    for n in lengths:
        prompt = fresh(n)
        llm.generate([prompt], params, use_tqdm=False)   # warm-up: compiles for this length stay out
        times = []
        for _ in range(args.repeats):
            prompt = fresh(n)   # fresh ids: no prefix-cache hit past the history
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        ttft = statistics.median(times)
        floor = prefill_flops(hf, n, args.cached) / rate
        print(f"{n:>7} {ttft * 1e3:>9.2f} {floor * 1e3:>9.2f} {ttft / floor:>12.2f}x")
        if args.host:
            print_host_split(llm, lambda: llm.generate([fresh(n)], params,
                                                       use_tqdm=False))
        if args.profile:   # a call is one whole prefill, fresh ids each time
            trace = os.path.join(args.trace, f"prefill-{n}.json") if args.trace else None
            print_gpu_profile(lambda: llm.generate([fresh(n)], params,
                                                   use_tqdm=False), calls=5, top=8, trace=trace, gaps=6)
    if args.beside:
        print_turns_beside_streams(llm, lengths, history, random_ids, args.beside, args.repeats)
    llm.close()


if __name__ == "__main__":
    main()
