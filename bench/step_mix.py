"""What kinds of steps nano-vllm's workload makes, through the real scheduler and block manager
with no model: pure decode, pure prefill, and mixed steps (prompt tokens beside decode rows), and
how many mixed steps fit the prefill graphs' largest bucket. Runs on the CPU in seconds.

    python bench/step_mix.py [--num-seqs 256,1024] [--num-blocks 4492]

The defaults are bench/throughput.py's on an H200 with the Qwen3-0.6B config: 4,492 KV blocks of
256 tokens (what its KV sizing finds), max_num_seqs 512, a 16,384-token budget.
"""

from __future__ import annotations

import argparse
import os
import sys
from random import Random

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nanoserve.engine.block_manager import BlockManager  # noqa: E402
from nanoserve.engine.scheduler import Scheduler  # noqa: E402
from nanoserve.engine.sequence import Sequence  # noqa: E402
from nanoserve.runner.prefill_graph import LARGEST_BUCKET  # noqa: E402
from nanoserve.sampling_params import SamplingParams  # noqa: E402


def step_mix(num_seqs: int, num_blocks: int, block_size: int, max_num_seqs: int, budget: int,
             seed: int = 0) -> dict[str, int]:
    rng = Random(seed)
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    scheduler = Scheduler(blocks, max_num_seqs, budget)
    for i in range(num_seqs):   # nano-vllm's lengths: prompts and outputs of 100-1,024 tokens
        prompt = [rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
        scheduler.add(Sequence(str(i), prompt, SamplingParams(max_tokens=rng.randint(100, 1024), ignore_eos=True)))
    counts = dict(steps=0, decode=0, prefill=0, mixed_in_graph_bucket=0, mixed_past_it=0, decode_rows_in_mixed=0)
    while scheduler.has_work:
        step = scheduler.schedule()
        counts["steps"] += 1
        decodes = sum(1 for seq in step.seqs if seq.num_computed_tokens >= seq.num_prompt_tokens)
        if decodes == len(step.seqs):
            counts["decode"] += 1
        elif decodes == 0:
            counts["prefill"] += 1
        else:
            counts["decode_rows_in_mixed"] += decodes
            fits = sum(step.num_new_tokens) <= LARGEST_BUCKET
            counts["mixed_in_graph_bucket" if fits else "mixed_past_it"] += 1
        for seq, n in zip(step.seqs, step.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens >= seq.num_tokens:   # the step sampled a token for it
                seq.token_ids.append(0)
                if seq.num_tokens - seq.num_prompt_tokens >= seq.max_tokens:
                    scheduler.finish(seq, "length")
    mixed = counts["mixed_in_graph_bucket"] + counts["mixed_past_it"]
    counts["decode_rows_in_mixed"] //= max(mixed, 1)   # a mean
    counts["preemptions"] = scheduler.num_preemptions
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", default="256,1024")
    parser.add_argument("--num-blocks", type=int, default=4492)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    args = parser.parse_args()
    for n in map(int, args.num_seqs.split(",")):
        counts = step_mix(n, args.num_blocks, args.block_size, args.max_num_seqs, args.max_num_batched_tokens)
        print(f"{n} seqs: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
