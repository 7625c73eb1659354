"""Time of one decode step against the memory-bound floor, at batch sizes 1-512 and contexts 1k-8k.

    python bench/decode_step.py --config bench/configs/qwen3-0.6b.json [--kv-cache-dtype fp8]

The floor is the bytes a decode step must read (all weights once, plus every sequence's K/V)
over the device-to-device copy bandwidth measured in the same run; with an fp8 cache the K/V
bytes (and so the floor) are those of one byte per element. A step is timed end to end
through ModelRunner.run (inputs, graph replay, logits, sampling, the one sync), median of many;
and pipelined, as the engine runs steps with async scheduling (the next one launched before the
last one's ids are read), mean over as many.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanoserve.benchmarks.config_file import config_from_file  # noqa: E402
from nanoserve.benchmarks.gpu_profile import print_gpu_profile  # noqa: E402
from nanoserve import SamplingParams  # noqa: E402
from nanoserve.runner.batch import SequenceWork  # noqa: E402
from nanoserve.runner.kv_cache import block_bytes  # noqa: E402
from nanoserve.runner.model_runner import ModelRunner  # noqa: E402


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * src.element_size() * 10 / (start.elapsed_time(end) / 1e3)


def time_step(runner: ModelRunner, work: list[SequenceWork], repeats: int) -> float:
    for _ in range(3):
        runner.run(work)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.run(work)  # ends in the sampled ids' device-to-host copy: synchronized
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_pipelined_step(runner: ModelRunner, work: list[SequenceWork], repeats: int) -> float:
    """Seconds per step as the engine runs them with async scheduling: step N+1 is launched,
    reading step N's sampled ids on the device, before step N's ids are read back."""
    piped = [dataclasses.replace(w, prev_row=i) for i, w in enumerate(work)]
    pending = runner.launch(work)
    for _ in range(3):
        pending, last = runner.launch(piped), pending
        last.result()
    start = time.perf_counter()
    for _ in range(repeats):
        pending, last = runner.launch(piped), pending
        last.result()
    pending.result()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="bench/configs/qwen3-0.6b.json")
    parser.add_argument("--batch-sizes", default="1,16,64,256,512")
    parser.add_argument("--contexts", default="1024,2048,4096,8192")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--pipelined-repeats", type=int, default=200,
                        help="pipelined steps timed (their mean): more than --repeats, since a small step is ~1 ms")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--profile", action="store_true",
                        help="also print kernels per step and the GPU time by kernel (torch.profiler)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]

    config = config_from_file(args.config, max_model_len=max(contexts) + 1, max_num_seqs=max(batches),
                              attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                              kv_cache_dtype=args.kv_cache_dtype)
    runner = ModelRunner(config, show_progress=True)
    bandwidth = copy_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    token_kv_bytes = block_bytes(config) // config.block_size
    params = SamplingParams(temperature=0.6)
    gen = torch.Generator().manual_seed(0)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, weights {weight_bytes / 1e9:.2f} GB, "
          f"KV {token_kv_bytes / 1024:.0f} KiB/token ({config.kv_cache_dtype}), {runner.num_blocks} blocks of {config.block_size}, "
          f"backend {runner.backend.name}, {'eager' if runner.graphs is None else 'cuda-graphs'}")
    print(f"{'batch':>6} {'context':>8} {'step ms':>9} {'floor ms':>9} {'floor/step':>10}   "
          f"(pipelined: steps launched as the engine does, before the last one is read)")
    for context in contexts:
        blocks_per_seq = -(-(context + 1) // config.block_size)
        for batch in batches:
            if batch * blocks_per_seq > runner.num_blocks:
                print(f"{batch:>6} {context:>8} {'(KV cache too small)':>30}")
                continue
            # shuffled physical blocks: no sequence reads a neighbour's memory by accident
            order = torch.randperm(runner.num_blocks, generator=gen)[:batch * blocks_per_seq].tolist()
            work = [SequenceWork([1] * (context + 1), context, context, 1,
                                 order[i * blocks_per_seq:(i + 1) * blocks_per_seq], params)
                    for i in range(batch)]
            seconds = time_step(runner, work, args.repeats)
            floor = (weight_bytes + batch * (context + 1) * token_kv_bytes) / bandwidth
            piped = time_pipelined_step(runner, work, args.pipelined_repeats)
            print(f"{batch:>6} {context:>8} {seconds * 1e3:>9.3f} {floor * 1e3:>9.3f} {floor / seconds:>10.2f} "
                  f"({seconds / floor:.2f}x floor; pipelined {piped * 1e3:.3f} ms, {piped / floor:.2f}x)")
            if args.profile:
                print_gpu_profile(lambda: runner.run(work))   # a call is one step


if __name__ == "__main__":
    main()
