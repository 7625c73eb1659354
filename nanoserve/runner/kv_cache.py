"""The paged KV cache: one K and one V tensor per layer, [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import logging

import torch

from nanoserve.config import EngineConfig
from nanoserve.runner.attention.fp8 import FP8_DTYPE
from nanoserve.runner.attention.kv_layout import v_cache_view
from nanoserve.runner.batch import SequenceWork
from nanoserve.runner.models.decoder import head_dim_of
from nanoserve.runner.parallel import TensorParallel
from nanoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 512 << 20


def local_kv_heads(config: EngineConfig) -> int:
    """KV heads on one rank (the same count on every rank)."""
    return TensorParallel(size=config.tensor_parallel_size).split_heads(config.hf_config.num_key_value_heads)[1]


def cache_dtype(config: EngineConfig) -> torch.dtype:
    return FP8_DTYPE if config.kv_cache_dtype == "fp8" else config.dtype


def block_bytes(config: EngineConfig) -> int:
    hf = config.hf_config
    per_token = 2 * hf.num_hidden_layers * local_kv_heads(config) * head_dim_of(hf) * cache_dtype(config).itemsize
    return per_token * config.block_size


def blocks_for_cpu(config: EngineConfig) -> int:
    # one sequence must fit, or it could never finish
    return max(config.blocks_per_sequence(), CPU_KV_CACHE_BYTES // block_bytes(config))


def blocks_for_gpu(config: EngineConfig, activation_peak: int, prefill_graph_pool: int = 0) -> int:
    """What fits in gpu_memory_utilization of the card after weights, other users, activations and
    the prefill graphs' pool (held beside the eager steps' memory)."""
    free, total = torch.cuda.mem_get_info()
    budget = total * config.gpu_memory_utilization - (total - free) - activation_peak - prefill_graph_pool
    num_blocks = int(budget // block_bytes(config))
    logger.info("KV cache: %d blocks of %d tokens (%.1f GiB); activation peak %.2f GiB, prefill graphs %.2f GiB",
                num_blocks, config.block_size, num_blocks * block_bytes(config) / 2**30, activation_peak / 2**30,
                prefill_graph_pool / 2**30)
    needed = config.blocks_per_sequence()   # one sequence must fit, or it could never finish
    if num_blocks < needed:
        graphs = (f", or run prefill steps eagerly (--no-prefill-cuda-graphs), which frees "
                  f"{prefill_graph_pool / 2**30:.2f} GiB") if prefill_graph_pool else ""
        raise ValueError(f"Only {max(num_blocks, 0)} KV blocks fit in gpu_memory_utilization="
                         f"{config.gpu_memory_utilization}; one sequence of max_model_len "
                         f"({config.max_model_len}) needs {needed}. Raise "
                         f"gpu_memory_utilization or lower max_model_len / max_num_batched_tokens{graphs}")
    return num_blocks


def profile_work(config: EngineConfig) -> list[SequenceWork]:
    """The largest step the scheduler can produce: a full token budget, max_num_seqs sampling rows,
    with top-k/top-p on so the sampler's sort is counted."""
    budget, num_seqs = config.max_num_batched_tokens, min(config.max_num_seqs, config.max_num_batched_tokens)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1)
    work, next_block = [], 0
    for i in range(num_seqs):
        n = budget // num_seqs + (1 if i < budget % num_seqs else 0)
        n = min(n, config.max_model_len)
        blocks = -(-n // config.block_size)
        work.append(SequenceWork([0] * n, n, 0, n, list(range(next_block, next_block + blocks)), params))
        next_block += blocks
    return work


class KVCache:
    """K and V of every layer in one tensor [2, layers, blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, config: EngineConfig, num_blocks: int, device: torch.device) -> None:
        hf = config.hf_config
        self.num_blocks = num_blocks
        shape = (2, hf.num_hidden_layers, num_blocks, config.block_size, local_kv_heads(config), head_dim_of(hf))
        self.fp8 = cache_dtype(config) == FP8_DTYPE
        # an fp8 V tile is read whole, past a sequence's end too: the cache holds no NaN (kv_layout).
        # On the CPU the pages are written now: left to first use, the process's memory grew by the
        # cache's size over the first thousands of requests, past what a limit sized at startup allowed
        zeroed = self.fp8 or device.type == "cpu"
        self.tensor = (torch.zeros if zeroed else torch.empty)(shape, dtype=cache_dtype(config), device=device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s K and V caches, V in the layout the kernels read (attention/kv_layout.py)."""
        return self.tensor[0, index], v_cache_view(self.tensor[1, index], self.fp8)
