"""How often an fp8 KV cache's greedy pick agrees with the auto (model-dtype) cache's, step by step.

Each of `steps` steps of a greedy run with the auto cache is scored with the fp8 cache given the same
history (prompt logprobs over prompt + that run's tokens), so one early flip does not decide every
later step; the free-running agreement, position by position, is reported beside it.

    python -m nanoserve.benchmarks.fp8_agreement --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from nanoserve.engine.llm import LLM
from nanoserve.sampling_params import SamplingParams

PROMPTS = ["The function returns", "A list is", "Return the value of", "The dictionary maps",
           "If the argument is", "This module provides", "Raise a ValueError when",
           "The default encoding is", "Open the file and", "A class defines", "The iterator yields",
           "Return a new string with", "The socket object", "When the thread starts",
           "The optional argument", "Decimal numbers are"]
STEPS = 64


def greedy_agreement(make_llm: Callable[[str], LLM], prompts: list[str] = PROMPTS,
                     steps: int = STEPS) -> tuple[float, float]:
    """(share of steps whose fp8-cache greedy pick, given the auto cache's history, is the auto
    cache's token; share of positions where the two free-running greedy runs agree).
    make_llm(kv_cache_dtype) builds the engine for "auto" and for "fp8"."""
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    reference = make_llm("auto")
    runs = reference.generate(prompts, params, use_tqdm=False)
    reference.close()
    fp8 = make_llm("fp8")
    scored = fp8.generate([r.prompt_token_ids + r.token_ids for r in runs],
                          SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    # entry len(prompt) + j: the top token at the position before run.token_ids[j]
    agree = 0
    for run, out in zip(runs, scored):
        entries = out.outputs[0].prompt_logprobs.entries()
        agree += sum(entries[len(run.prompt_token_ids) + j][1][0][0] == token for j, token in enumerate(run.token_ids))
    free = fp8.generate(prompts, params, use_tqdm=False)
    same = sum(a == b for r, f in zip(runs, free) for a, b in zip(r.token_ids, f.token_ids))
    fp8.close()
    total = steps * len(prompts)
    return agree / total, same / total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: the bundled model)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", help="the compute dtype")
    parser.add_argument("--attention-backend", default="triton")
    args = parser.parse_args(argv)

    def make_llm(kv_cache_dtype: str) -> LLM:
        return LLM(args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                   max_model_len=1024, num_kvcache_blocks=64, kv_cache_dtype=kv_cache_dtype)

    agree, free = greedy_agreement(make_llm)
    print(f"fp8 cache, {args.dtype} compute: "
          f"greedy picks agree at {agree:.1%} of {STEPS * len(PROMPTS)} steps given the auto cache's history; "
          f"free-running {free:.1%}")


if __name__ == "__main__":
    main()
