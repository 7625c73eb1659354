"""Offline throughput on nano-vllm's workload: random prompts, random output lengths, ignore_eos.

    python bench/throughput.py --config bench/configs/qwen3-0.6b.json --num-seqs 256

Prints one line: output tokens, seconds, tokens/s. Weight init, KV sizing, graph capture and a
warm-up generation are excluded from the timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from random import Random

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import config_from_file  # noqa: E402
from nanoserve import SamplingParams  # noqa: E402
from nanoserve.engine.llm import LLM  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="bench/configs/qwen3-0.6b.json")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-input-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--min-output-len", type=int, default=100)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="launch step N+1 before reading step N's sampled ids (default: on for CUDA)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--trace", metavar="DIR", default=None,
                        help="after the timed run, run again recording step times and a torch.profiler window")
    args = parser.parse_args()

    config = config_from_file(args.config, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
                              async_scheduling=args.async_scheduling, attention_backend=args.attention_backend, block_size=args.block_size,
                              gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
                              tensor_parallel_size=args.tensor_parallel_size)
    llm = LLM(config=config)
    rng = Random(args.seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, detokenize=False,
                             max_tokens=rng.randint(args.min_output_len, args.max_output_len))
              for _ in range(args.num_seqs)]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16, detokenize=False), use_tqdm=False)  # warm-up

    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    assert tokens == sum(p.max_tokens for p in params)
    backend = llm.engine.runner.backend.name
    graphs = "eager" if llm.engine.runner.graphs is None else "cuda-graphs"
    graphs += ", async scheduling" if config.async_scheduling else ", sync scheduling"
    print(f"throughput: {tokens} output tokens in {seconds:.2f} s = {tokens / seconds:.0f} tok/s "
          f"({args.num_seqs} seqs, {os.path.basename(args.config)}, {backend}, {graphs}, "
          f"block {config.block_size}, tp {config.tensor_parallel_size}, "
          f"preemptions {llm.engine.scheduler.num_preemptions})")
    if args.trace:
        from bench.step_trace import StepTrace
        with StepTrace(llm.engine, args.trace):
            llm.generate(prompts, params, use_tqdm=False)
    llm.close()


if __name__ == "__main__":
    main()
