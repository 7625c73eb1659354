"""vLLM `serve` flags that deployments carry over, taken with the meaning they have here.

A command line or manifest written for vLLM often sets flags whose job this server does another
way, or does not need. Each is accepted only where its value changes nothing a client sees,
and refused by name where it asks for something this server cannot do:

- `--response-role`: the role of a chat reply (`assistant`), honoured;
- `--enable-log-requests` / `--no-enable-log-requests`: vLLM's newer switch for the per-request log
  line (`--disable-log-requests` is the older one; both work);
- `--enable-prompt-tokens-details`: usage carries `prompt_tokens_details` (cached tokens) always here;
- `--swap-space`: a preempted request is recomputed, as in vLLM's V1 engine: nothing is swapped;
- `--disable-custom-all-reduce`: tensor parallelism reduces through NCCL (gloo on the CPU) only;
- `--disable-sliding-window`: as in vLLM, a sliding window is left out (full attention) and the context
  capped at it;
- `--pipeline-parallel-size`, `--data-parallel-size`: 1 (one model replica over
  `--tensor-parallel-size` GPUs); more is refused;
- `--guided-decoding-backend`: auto or xgrammar, the structured-output backend here;
- `--tokenizer-mode`: auto or hf, transformers' tokenizer of the model (vLLM's slow, mistral and
  custom modes are refused);
- `--task`, `--runner`: generate (or auto) only;
- `--quantization fp8|compressed-tensors`: the checkpoint's own method, which is read without the flag
  (checkpoint_quantization.py); a checkpoint quantized otherwise, or not at all, is refused;
- refused by name, with what to do instead: `--enable-lora`, `--lora-modules`,
  `--speculative-config`, `--limit-mm-per-prompt`, `--hf-overrides`, `-O`/`--compilation-config`,
  `--cpu-offload-gb`, `--kv-transfer-config`. argparse's "unrecognized arguments" said only that.

Nothing here imports torch: `--help` answers at once.
"""

from __future__ import annotations

import argparse
import math

from nanoserve.checkpoint_quantization import READ_METHODS

GUIDED_DECODING_BACKENDS = ("auto", "xgrammar")
TOKENIZER_MODES = ("auto", "hf")
MAX_ROLE_CHARS = 64
GENERATE_TASKS = ("auto", "generate")
_NO_LORA = "LoRA adapters are not served here; merge the adapter into the weights first"
# vLLM flags for what this server does not do, and what to do instead
REFUSED_FLAGS = {
    ("--enable-lora",): _NO_LORA,
    ("--lora-modules",): _NO_LORA,
    ("--speculative-config",): "speculative decoding is not offered here",
    ("--limit-mm-per-prompt",): "this server serves text-only models",
    ("--hf-overrides",): "edit the model folder's config.json instead",
    ("--compilation-config", "-O"): "the CUDA graphs and kernels are chosen here by themselves "
                                    "(--enforce-eager turns the graphs off)",
    ("--cpu-offload-gb",): "weights are not offloaded to the CPU here; use --tensor-parallel-size for a model "
                           "too large for one GPU",
    ("--kv-transfer-config",): "disaggregated prefill is not offered here",
}


class _Refused(argparse.Action):
    """A flag vLLM has and this server refuses, at parse time, with the reason."""

    def __init__(self, option_strings: list[str], dest: str, reason: str = "", **kwargs) -> None:
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                         **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is not supported by this server: {self.reason}")


def add_vllm_serve_flags(p: argparse.ArgumentParser) -> None:
    for flags, reason in REFUSED_FLAGS.items():
        p.add_argument(*flags, action=_Refused, reason=reason)
    for flag in ("--task", "--runner"):
        p.add_argument(flag, default="generate", choices=GENERATE_TASKS,
                       help="generate only: this server runs text generation models")
    p.add_argument("--response-role", default="assistant",
                   help="the role a chat reply speaks as (when add_generation_prompt is true)")
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=None,
                   help="a log line per finished request (vLLM's newer name; on unless this is --no-... "
                        "or --disable-log-requests is given)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage's prompt_tokens_details (cached tokens): always included here")
    p.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                   help="taken for vLLM's command lines; a preempted request is recomputed, as in vLLM's V1 "
                        "engine, so no CPU memory is set aside")
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="taken for vLLM's command lines: tensor parallelism reduces through NCCL only")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="1 only: the model runs whole on each of --tensor-parallel-size GPUs' shards")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="1 only: one model replica a server (run servers side by side for more)")
    p.add_argument("--disable-sliding-window", action="store_true",
                   help="as in vLLM: a model's sliding-window attention is computed as full attention, and the "
                        "context (max_model_len) is capped at the window, within which the two are the same")
    p.add_argument("--guided-decoding-backend", default="auto", choices=GUIDED_DECODING_BACKENDS,
                   help="structured outputs: xgrammar is the backend here, whichever is named")
    p.add_argument("--quantization", "-q", default=None, choices=READ_METHODS,
                   help="the checkpoint's quantization, which is read without this flag: fp8 weights are "
                        "widened to the model's dtype at load")
    p.add_argument("--tokenizer-mode", default="auto", choices=TOKENIZER_MODES,
                   help="the model's tokenizer as transformers loads it, whichever is named")


def check_vllm_serve_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """parser.error for what these flags ask and this server cannot do."""
    if args.pipeline_parallel_size != 1:
        parser.error(f"--pipeline-parallel-size {args.pipeline_parallel_size} is not offered: the model is split "
                     "over GPUs by --tensor-parallel-size only; leave the flag at 1")
    if args.data_parallel_size != 1:
        parser.error(f"--data-parallel-size {args.data_parallel_size} is not offered: a server runs one model "
                     "replica; run one server per replica behind a load balancer, and leave the flag at 1")
    if args.swap_space is not None and not 0 <= args.swap_space < math.inf:
        parser.error(f"--swap-space must be a number of GiB >= 0, got {args.swap_space}")
    role = args.response_role
    if not role or len(role) > MAX_ROLE_CHARS or not role.isprintable() or role != role.strip():
        parser.error(f"--response-role must be a role name of 1-{MAX_ROLE_CHARS} printable characters without "
                     f"leading or trailing spaces, got {role[:80]!r}")
    if args.enable_log_requests and args.disable_log_requests:
        parser.error("--enable-log-requests and --disable-log-requests contradict each other: give one")


def log_requests(args: argparse.Namespace) -> bool:
    """Whether a line is logged per finished request: unless either flag turns it off."""
    return not args.disable_log_requests and args.enable_log_requests is not False
