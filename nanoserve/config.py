"""The one validated configuration object, built from CLI flags or keyword arguments."""

from __future__ import annotations

import logging
import numbers
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from nanoserve.attention_support import attention_refusal
from nanoserve.checkpoint_quantization import check_quantization, fp8_weights
from nanoserve.defaults import (ATTENTION_BACKENDS, DEFAULT_MODEL, FP8_FLASH_ATTN_REFUSAL,  # noqa: F401 - re-exported
                                DEFAULT_MAX_LOGPROBS, KV_CACHE_DTYPES, MAX_GRAMMAR_BYTES, MAX_GRAMMAR_STATE_BYTES,
                                MAX_LOGPROBS_CEILING, MAX_NUM_SEQS, SCHEDULING_POLICIES)
from nanoserve.model_source import resolve_model
from nanoserve.positions import context_limit, kv_window, sliding_window
from nanoserve.sampling_params import SEED_RANGE

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "half": torch.float16, "float": torch.float32}


def resolve_dtype(name: str | torch.dtype | None, hf_config: PretrainedConfig, device: str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        found = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(found, str):
            found = _DTYPES.get(found)
        found = found or torch.float32
        # half precision matmuls on the CPU are slow and inexact: keep the CPU path in float32
        return torch.float32 if device == "cpu" else found
    if name not in _DTYPES:
        raise ValueError(f"Unknown dtype {name!r}; choose one of {sorted(set(_DTYPES))} or 'auto'")
    return _DTYPES[name]


def _read_hf_config(model: str, trust_remote_code: bool) -> PretrainedConfig:
    """The folder's config.json as transformers reads it; ValueError naming the file when it cannot
    be read: transformers raises OSError for bad JSON, the Hub's dataclasses their own error for a
    field of the wrong type, and a caller (the CLI) turns only ValueError into a refusal."""
    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as exc:   # noqa: BLE001 - whatever fails here, the file is the cause
        raise ValueError(f"{os.path.join(model, 'config.json')} cannot be read as a model's config: "
                         f"{type(exc).__name__}: {exc}") from exc


# the field annotations (" | None" aside) whose values are checked: the type a value becomes, the
# types it may come as, and how the refusal names them
_CHECKED = {"int": (int, numbers.Integral, "an integer"), "float": (float, numbers.Real, "a number"),
            "bool": (bool, bool, "True or False"), "str": (str, (str, os.PathLike), "a string")}


def _typed_fields(config: EngineConfig) -> dict[str, Any]:
    """The fields to set before anything reads them, as vLLM reads its engine arguments: None means
    the field's default (code passes its own optional values through: seed=None failed on a
    comparison, enable_prefix_caching=None turned the cache off), and a value of another type is a
    ValueError naming the field (max_model_len=64.0 failed deep inside, as an AttributeError).
    Integers of other kinds (numpy's) become int, paths become str."""
    changed: dict[str, Any] = {}
    for f in fields(config):
        value, checked = getattr(config, f.name), _CHECKED.get(f.type.removesuffix(" | None"))
        if value is None:
            if f.default is not MISSING and f.default is not None:
                changed[f.name] = f.default
        elif checked is not None:
            kind, accepted, name = checked
            if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
                raise ValueError(f"{f.name} must be {name}, got {value!r}")
            if type(value) is not kind:
                changed[f.name] = os.fspath(value) if isinstance(value, os.PathLike) else kind(value)
    return changed


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine and runner need to start. Unset values are derived in __post_init__."""

    # a folder, or a Hugging Face Hub repository id (fetched at `revision` into the Hub's cache, or
    # into `download_dir`; nanoserve/model_source.py), which becomes the snapshot's folder
    model: str = DEFAULT_MODEL
    revision: str | None = None
    download_dir: str | None = None
    tokenizer: str | None = None
    # let transformers run the model folder's own Python (a custom tokenizer or config class)
    trust_remote_code: bool = False
    device: str | None = None
    dtype: Any = None
    max_model_len: int | None = None
    # vLLM's: a model's sliding-window attention is left out (full attention), and the context
    # (max_model_len) capped at the window, within which the two are the same
    disable_sliding_window: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # vLLM's: "fcfs" serves in arrival order; "priority" by each request's priority (lower first),
    # preempting running sequences of a lower one when a higher one finds no room
    scheduling_policy: str = "fcfs"
    block_size: int | None = None
    num_kvcache_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    enforce_eager: bool = False
    # CUDA graphs for prefill and mixed steps too (runner/prefill_graph.py): one graph
    # replay instead of a Python launch per kernel (a lone 1k prompt: 16.6 -> 4.5 ms on an H200).
    # None: on where they can run (one CUDA GPU, graphs on, Triton attention); True: refused elsewhere
    prefill_cuda_graphs: bool | None = None
    # launch step N+1 before reading step N's sampled ids; None: on for CUDA, where the host's
    # bookkeeping then overlaps the device's work, off on the CPU, where nothing runs beside it
    async_scheduling: bool | None = None
    attention_backend: str = "auto"
    # fp8: K and V stored as e4m3 with a per-layer scale (1.0, or the checkpoint's k_scale/v_scale);
    # vLLM's other spelling, fp8_e4m3, is taken as fp8
    kv_cache_dtype: str = "auto"
    # vLLM's: the checkpoint's own quantization method (fp8, compressed-tensors), which is read without
    # it; checked against the checkpoint, since weights are never quantized at load here
    quantization: str | None = None
    # vLLM's: the most alternatives a request's logprobs or prompt_logprobs may ask for (up to MAX_LOGPROBS_CEILING)
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    tensor_parallel_size: int = 1
    # torch's threads per rank on the CPU; None: torch's default, shared among the ranks
    # (nanoserve/cpu_threads.py; `serve` keeps a core for its front end)
    cpu_threads: int | None = None
    seed: int = 0
    # compiled grammars that running and queued sequences may hold at once, by xgrammar's count of
    # their size; a request whose grammar does not fit waits (engine/grammar_queue.py)
    max_grammar_bytes: int = MAX_GRAMMAR_BYTES
    # what the engine may grow by while sequences hold grammars (matchers' state grows with each
    # token); past it the constrained requests that accepted the most are ended (engine/grammar_state.py)
    max_grammar_state_bytes: int = MAX_GRAMMAR_STATE_BYTES
    hf_config: PretrainedConfig | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        for name, value in _typed_fields(self).items():
            set_(name, value)
        set_("model", resolve_model(self.model, self.revision, self.download_dir, self.trust_remote_code))
        if self.hf_config is None:
            set_("hf_config", _read_hf_config(self.model, self.trust_remote_code))
        set_("tokenizer", self.tokenizer or self.model)
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu', 'cuda' or None (auto), got {self.device!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            # never fall back to the CPU silently: a GPU server that serves from the CPU looks up but crawls
            raise ValueError(f"device={device!r} was asked for but torch sees no CUDA device "
                             f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); in Docker, run with "
                             "--gpus all, or pass --device cpu to serve from the CPU")
        set_("device", device)
        set_("dtype", resolve_dtype(self.dtype, self.hf_config, device))
        # a quantization whose weights cannot be read is refused before loading, as is one asked for wrongly
        check_quantization(fp8_weights(self.hf_config), self.quantization)
        self._check_tensor_parallel(device)
        if self.async_scheduling is None:
            set_("async_scheduling", device != "cpu")

        limit = context_limit(self.hf_config)
        # the attention kernels compute a sliding window (positions.layer_windows); disabled, as in vLLM,
        # the layers attend in full, which within the window is the same attention
        window = sliding_window(self.hf_config) if self.disable_sliding_window else None
        if window is not None and window < limit:
            limit = window
            if self.max_model_len is None:
                logger.info("max_model_len defaults to %d, the model's sliding-window attention span "
                            "(--disable-sliding-window)", window)
        if self.max_model_len is None:
            set_("max_model_len", limit)
        elif window is not None and self.max_model_len > window:
            raise ValueError(f"max_model_len ({self.max_model_len}) is past the model's sliding-window attention "
                             f"span ({window} tokens), to which disable_sliding_window caps the context: pass "
                             f"max_model_len <= {window}, or leave the window on")
        elif self.max_model_len > limit:
            raise ValueError(f"max_model_len ({self.max_model_len}) is larger than the model's context ({limit}: "
                             "max_position_embeddings, stretched by a linear or yarn rope_scaling where it has one)")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_num_batched_tokens is None:
            default = 8192 if device != "cpu" else 2048
            set_("max_num_batched_tokens", default if self.enable_chunked_prefill
                 else max(default, self.max_model_len))
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_model_len ({self.max_model_len}) unless chunked prefill is enabled")
        if self.max_num_seqs > MAX_NUM_SEQS:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) is more than {MAX_NUM_SEQS} sequences a step; "
                             "lower --max-num-seqs")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"need 1 <= max_num_seqs ({self.max_num_seqs}) <= "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens}): every running "
                             f"sequence decodes a token each step; lower --max-num-seqs or raise "
                             f"--max-num-batched-tokens")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8_e4m3":
            set_("kv_cache_dtype", "fp8")
        if type(self.max_logprobs) is not int or not 0 <= self.max_logprobs <= MAX_LOGPROBS_CEILING:
            raise ValueError(f"max_logprobs must be an integer in 0-{MAX_LOGPROBS_CEILING}, got {self.max_logprobs!r} "
                             "(vLLM's -1, the whole vocabulary, is not offered: every alternative is carried for "
                             "every token)")
        refusal = self._prefill_graphs_refusal(device)
        if self.prefill_cuda_graphs and refusal:
            raise ValueError(f"prefill_cuda_graphs (--prefill-cuda-graphs) cannot be used here: {refusal}")
        if self.prefill_cuda_graphs is None:
            set_("prefill_cuda_graphs", refusal is None)
        if self.block_size is None:
            set_("block_size", 16 if device == "cpu" else 256)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        # every sequence holds at least one whole block, and the torch backend reads it whole: with
        # --block-size 1048576 the server made 0.7 tokens a second, and 2**30 asked for 4 TiB at startup
        largest = max(256, 1 << (self.max_model_len - 1).bit_length())   # 256: CUDA's default, flash_attn's block
        if self.block_size > largest:
            raise ValueError(f"block_size ({self.block_size}) is more than a sequence of max_model_len "
                             f"({self.max_model_len}) can fill; use a block_size of at most {largest}")
        self._check_attention_backend(device)
        if self.num_kvcache_blocks is not None:
            needed = self.blocks_per_sequence()
            if self.num_kvcache_blocks < needed:
                raise ValueError(f"num_kvcache_blocks ({self.num_kvcache_blocks}) cannot hold one sequence "
                                 f"of max_model_len ({self.max_model_len}): need at least {needed} blocks "
                                 f"of {self.block_size} tokens")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {self.cpu_threads}")
        if self.max_grammar_bytes < 1:
            raise ValueError(f"max_grammar_bytes must be at least 1, got {self.max_grammar_bytes}")
        if self.max_grammar_state_bytes < 1:
            raise ValueError(f"max_grammar_state_bytes must be at least 1, got {self.max_grammar_state_bytes}")
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            # past it torch.manual_seed failed in the engine's process with "Overflow when unpacking long long"
            raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] (what torch's generator takes), "
                             f"got {self.seed}")

    def _prefill_graphs_refusal(self, device: str) -> str | None:
        """Why prefill graphs cannot run here (None: they can). They replay the Triton prefill
        kernel on one GPU; auto's pick of flash_attn is known only to the runner."""
        return ("--enforce-eager turns CUDA graphs off" if self.enforce_eager else
                "they run on one GPU" if self.tensor_parallel_size > 1 else
                f"they need the triton attention backend, not {self.attention_backend}"
                if self.attention_backend in ("torch", "flash_attn") else
                "they need CUDA" if not device.startswith("cuda") else None)

    def _check_attention_backend(self, device: str) -> None:
        """Refuse a backend that cannot run here, or would compute wrongly, before a weight loads:
        the runner's own refusal comes only once the model is in memory, in the engine's process."""
        name = self.attention_backend
        if name == "auto":
            # on CUDA auto is triton unless flash_attn takes it, which needs blocks of 256
            name = "triton" if device.startswith("cuda") and self.block_size % 256 else None
        why = name and attention_refusal(name, device, self.block_size, self.kv_cache_dtype, self.dtype)
        if why:
            raise ValueError(why)

    @property
    def kv_window(self) -> int | None:
        """The keys behind a sequence's end that its queries can still attend, where every layer
        slides (positions.kv_window); None where some layer attends in full."""
        return kv_window(self.hf_config, self.max_model_len)

    def blocks_per_sequence(self) -> int:
        """The most KV blocks one sequence holds at once: those of max_model_len tokens, or under a
        kv_window a step's chunk and the window - 1 keys before it, over at most one block more than
        they fill: the block manager gives back the blocks behind them."""
        full = -(-self.max_model_len // self.block_size)
        window = self.kv_window
        if window is None:
            return full
        return min(full, -(-(window - 1 + self.max_num_batched_tokens) // self.block_size) + 1)

    def _check_tensor_parallel(self, device: str) -> None:
        size, hf = self.tensor_parallel_size, self.hf_config
        if size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
        if size == 1:
            return
        if device.startswith("cuda") and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; {torch.cuda.device_count()} are visible")
        heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
        if heads % size or hf.intermediate_size % size:
            raise ValueError(f"tensor_parallel_size {size} must divide the model's {heads} attention heads and "
                             f"its intermediate_size {hf.intermediate_size}")
        if kv_heads % size and size % kv_heads:
            raise ValueError(f"tensor_parallel_size {size} and the model's {kv_heads} KV heads must divide "
                             "one another")

