"""The flags of the engine that `serve` and `generate` share, and the EngineConfig fields they make.

Nothing here imports torch: `--help` answers at once.
"""

from __future__ import annotations

import argparse
import os
import re
from decimal import Decimal

from nanoserve.defaults import (ATTENTION_BACKENDS, DEFAULT_MAX_LOGPROBS, DEFAULT_MODEL, KV_CACHE_DTYPES,
                                MAX_GRAMMAR_BYTES, MAX_GRAMMAR_STATE_BYTES, MAX_LOGPROBS_CEILING, SCHEDULING_POLICIES)


# vLLM's human-readable sizes: a lower-case suffix counts in thousands (25.6k), an upper-case one in 1,024s (16K)
_HUMAN_INT = re.compile(r"(\d{1,20}(?:\.\d{1,20})?)([kmgtKMGT]?)")   # 20 digits: past any size
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_int(value: str) -> int:
    """An integer flag as vLLM reads it: 8192, 25.6k (25,600) or 16K (16,384)."""
    text = value.strip()
    match = _HUMAN_INT.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r} (give a number such as 4096, 32k or 32K)")
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(Decimal(number) * _DECIMAL[suffix])   # exact: 1.001k is 1,001, not float's 1,000
    if "." in number:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}: a fraction takes a lower-case suffix "
                                         f"(thousands, such as {number}k), not a binary one")
    return int(number) * _BINARY.get(suffix, 1)


def human_int_or_auto(value: str) -> int | None:
    """human_int, or None (the model's own) for auto and -1."""
    return None if value.strip().lower() in ("auto", "-1") else human_int(value)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine's flags on a subcommand's parser; `engine_kwargs` turns them into EngineConfig fields."""
    p.add_argument("--dtype", default="auto", help="auto (the model's, float32 on the CPU), float32, float16, bfloat16")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--max-model-len", type=human_int_or_auto, default=None,
                   help="context length, as 4096, 32k (32,000) or 32K (32,768); auto or -1: the model's (the default)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one batch (at most 65,536)")
    p.add_argument("--max-num-batched-tokens", type=human_int, default=None,
                   help="token budget of one step, as 8192 or 8K (default: 8192 on CUDA, 2048 on the CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory to use")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block, a power of two (default: 256 on CUDA, 16 on the CPU)")
    p.add_argument("--num-kvcache-blocks", type=int, default=None, help="KV-cache blocks (default: from memory)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="share KV blocks of equal prefixes (vLLM's spelling; on by default)")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not share KV blocks of equal prefixes")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over steps of --max-num-batched-tokens; off: a prompt runs in one "
                        "step (the default token budget then grows to --max-model-len)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                   help="fcfs: first come, first served; priority: by each request's 'priority' (lower first, then "
                        "arrival), preempting running requests of a lower priority when a higher one finds no room")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="auto: flash_attn when it imports (fp16/bf16 models, KV cache not fp8), else triton on CUDA, "
                        "torch on the CPU")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="fp8 (or vLLM's other name for it, fp8_e4m3): K/V stored as e4m3 (twice the tokens fit; "
                        "scales from the checkpoint or 1.0)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--prefill-cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="also replay prefill steps of up to 4 sequences from CUDA graphs, so a short prompt's "
                        "time to first token is mostly GPU time (default: on where they can run: one GPU, "
                        "CUDA graphs on, Triton attention)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch the next step before reading this one's sampled ids, overlapping host and "
                        "GPU (default: on for CUDA, off on the CPU)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    p.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS,
                   help="most alternatives a request's logprobs, top_logprobs or prompt_logprobs may ask for "
                        f"(vLLM's flag and default), at most {MAX_LOGPROBS_CEILING}: vLLM's -1, the whole vocabulary, "
                        "is not offered")
    p.add_argument("--revision", default=None,
                   help="the Hub repository's branch, tag or commit when the model is a repository id (default: main)")
    p.add_argument("--download-dir", default=None,
                   help="where a Hub repository's files are kept (default: the Hugging Face cache, $HF_HOME)")
    p.add_argument("--hf-token", default=None,
                   help="token for gated or private Hub repositories (default: $HF_TOKEN, or `hf auth login`'s)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run Python files of the model folder (a custom tokenizer or config)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many GPUs (or CPU processes), one worker process each")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: random weights, for benchmarks")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and of unseeded sampling")
    p.add_argument("--max-grammar-bytes", type=int, default=MAX_GRAMMAR_BYTES,
                   help="compiled grammars (structured outputs) that running and waiting requests may hold at "
                        "once, by xgrammar's count of their size; a request whose grammar does not fit waits")
    p.add_argument("--max-grammar-state-bytes", type=int, default=MAX_GRAMMAR_STATE_BYTES,
                   help="what the engine may grow by while requests hold grammars (a matcher's state grows with "
                        "every token); past it the structured-output requests that accepted the most tokens are ended")


def _prefix_caching(args: argparse.Namespace) -> bool:
    if args.no_prefix_caching and args.enable_prefix_caching:
        raise ValueError("--no-prefix-caching and --enable-prefix-caching contradict each other: give one")
    return not args.no_prefix_caching and args.enable_prefix_caching is not False


def engine_kwargs(args: argparse.Namespace, model: str | None) -> dict:
    """EngineConfig fields from the flags shared by `serve` and `generate`."""
    if args.hf_token:   # the Hub's own variable: every download, the tokenizer's included, reads it
        os.environ["HF_TOKEN"] = args.hf_token
    return dict(
        model=model or DEFAULT_MODEL, revision=args.revision, download_dir=args.download_dir, device=args.device,
        dtype=args.dtype, max_model_len=args.max_model_len,
        # a vLLM serve flag (vllm_flags.py): `generate` has no such flag
        disable_sliding_window=getattr(args, "disable_sliding_window", False),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
        num_kvcache_blocks=args.num_kvcache_blocks, enable_prefix_caching=_prefix_caching(args),
        enable_chunked_prefill=args.enable_chunked_prefill, scheduling_policy=args.scheduling_policy,
        trust_remote_code=args.trust_remote_code,
        attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager,
        prefill_cuda_graphs=args.prefill_cuda_graphs, async_scheduling=args.async_scheduling,
        load_format=args.load_format, seed=args.seed, max_grammar_bytes=args.max_grammar_bytes,
        max_grammar_state_bytes=args.max_grammar_state_bytes,
        tensor_parallel_size=args.tensor_parallel_size, tokenizer=args.tokenizer,
        max_logprobs=args.max_logprobs, quantization=getattr(args, "quantization", None))
