"""Offline throughput on nano-vllm's workload: random prompts, random output lengths, ignore_eos.

    nanoserve bench throughput --config bench/configs/qwen3-0.6b.json --num-seqs 256
    python bench/throughput.py ...   (the same)

The model is a config.json with random weights (`--config`), or a model folder (`--model`).
Prints one line per run: output tokens, seconds, tokens/s. Weight init, KV sizing, graph capture
and a warm-up generation are excluded from the timing. The workload runs `--runs` times in one
engine, as nano-vllm's harness runs its 256 sequences twice in one process: the first run is
cold, later runs find the same prompts in the prefix cache (each line says how many prompt
tokens were computed). Compare like with like: cold with nano-vllm's cold run, warm with its warm.

`--json-schema` constrains every request with a JSON schema (structured outputs) whose string
cannot close before max_tokens, so the lengths stay nano-vllm's; it also prints how long a large
schema takes to compile.
"""

from __future__ import annotations

import argparse
import os
import time
from random import Random

from nanoserve import EngineConfig, SamplingParams
from nanoserve.benchmarks.compile_watch import describe, triton_compiles
from nanoserve.benchmarks.config_file import config_from_file
from nanoserve.engine.llm import LLM
from nanoserve.engine_flags import human_int
from nanoserve.structured_outputs_params import StructuredOutputsParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve bench throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="bench/configs/qwen3-0.6b.json",
                        help="a model's config.json, run with random weights")
    parser.add_argument("--model", default=None, help="a model folder with weights (instead of --config)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-input-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--min-output-len", type=int, default=100)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-model-len", type=human_int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=human_int, default=16384)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-k", type=int, default=-1, help="-1: off (Qwen3's generation config asks for 20)")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0: off (Qwen3's generation config asks for 0.95)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--prefill-cuda-graphs", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="launch step N+1 before reading step N's sampled ids (default: on for CUDA)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--max-token-id", type=int, default=10000, help="prompt ids are drawn from 0..this")
    parser.add_argument("--device", default=None)
    parser.add_argument("--json-schema", action="store_true",
                        help="constrain every request with a JSON schema (structured outputs)")
    parser.add_argument("--runs", type=int, default=2,
                        help="run the workload this many times in one engine (run 2 on: prompts in the prefix cache)")
    parser.add_argument("--trace", metavar="DIR", default=None,
                        help="after the timed run, run again recording step times and a torch.profiler window")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model is None and not os.path.isfile(args.config):
        # the default is the repository's file: run elsewhere (an installed package, the image) it
        # was a FileNotFoundError traceback
        parser.error(f"--config {args.config!r} is not a file: run from the repository's root, or give "
                     "--config CONFIG.json (random weights) or --model FOLDER")
    settings = dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
                    prefill_cuda_graphs=args.prefill_cuda_graphs, async_scheduling=args.async_scheduling,
                    attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
                    block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
                    tensor_parallel_size=args.tensor_parallel_size, device=args.device)
    config = (EngineConfig(model=args.model, **settings) if args.model
              else config_from_file(args.config, full_vocab_tokenizer=args.json_schema, **settings))
    llm = LLM(config=config)
    rng = Random(args.seed)
    prompts = [[rng.randint(0, args.max_token_id) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_seqs)]
    schema = None
    if args.json_schema:
        # a long string of tokens of ~1-8 characters: it cannot close before max_tokens
        schema = StructuredOutputsParams(json={"type": "object", "required": ["text"], "properties": {
            "text": {"type": "string", "minLength": 16 * args.max_output_len}}})
        print(f"grammar compile: {large_schema_compile_ms(llm):.0f} ms for a schema of 200 fields")
    params = [SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             ignore_eos=True, detokenize=False,
                             max_tokens=rng.randint(args.min_output_len, args.max_output_len),
                             structured_outputs=schema)
              for _ in range(args.num_seqs)]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16, detokenize=False), use_tqdm=False)  # warm-up

    backend = llm.engine.runner.backend.name
    graphs = "eager" if llm.engine.runner.graphs is None else "cuda-graphs"
    graphs += " + prefill graphs" if llm.engine.runner.prefill_graphs is not None else ""
    graphs += ", async scheduling" if config.async_scheduling else ", sync scheduling"
    graphs += ", json_schema" if schema else ""
    prompt_tokens = sum(map(len, prompts))
    scheduler = llm.engine.scheduler
    for run in range(1, args.runs + 1):
        with triton_compiles() as compiles:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outputs)
        assert tokens == sum(p.max_tokens for p in params)
        computed = prompt_tokens - sum(o.num_cached_tokens for o in outputs)
        print(f"throughput: {tokens} output tokens in {seconds:.2f} s = {tokens / seconds:.0f} tok/s "
              f"({args.num_seqs} seqs, {os.path.basename(args.model or args.config)}, {backend}, {graphs}, "
              f"block {config.block_size}, kv {config.kv_cache_dtype} in {scheduler.block_manager.num_blocks} blocks, "
              f"tp {config.tensor_parallel_size}, "
              f"preemptions {scheduler.num_preemptions}, run {run} of {args.runs}: "
              f"{computed} of {prompt_tokens} prompt tokens computed)")
        if compiles:
            print(f"triton compiles inside run {run}: {describe(compiles)}")
    if args.trace:
        from nanoserve.benchmarks.step_trace import StepTrace
        with StepTrace(llm.engine, args.trace):
            llm.generate(prompts, params, use_tqdm=False)
    llm.close()


def large_schema_compile_ms(llm: LLM) -> float:
    """Milliseconds to compile a 200-field object schema (nested objects, enums, bounds, arrays)."""
    from nanoserve.engine.grammar import compile_spec

    kinds = [{"type": "string", "maxLength": 64}, {"type": "integer", "minimum": 0, "maximum": 10_000},
             {"type": "number", "minimum": -1, "maximum": 1}, {"enum": ["red", "green", "blue"]},
             {"type": "array", "items": {"type": "string"}, "maxItems": 8},
             {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "boolean"}},
              "required": ["x", "y"]}]
    fields = {f"field_{i}": kinds[i % len(kinds)] for i in range(200)}
    spec = StructuredOutputsParams(json={"type": "object", "properties": fields, "required": list(fields)[::2]})
    start = time.perf_counter()
    compile_spec(llm.engine.grammars.compiler, spec)
    return (time.perf_counter() - start) * 1e3


if __name__ == "__main__":
    main()
