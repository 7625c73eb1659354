"""What the attention benchmarks share: the Qwen3-0.6B attention shapes, a cache of shuffled
blocks, and timing inside a CUDA graph."""

from __future__ import annotations

import torch
from triton.testing import do_bench

from nanoserve.runner.attention.fp8 import FP8_DTYPE
from nanoserve.runner.attention.kv_layout import v_cache_copy

KV_HEADS, HEAD_DIM, BLOCK = 8, 128, 256   # q heads: KV_HEADS x the GQA group asked
DTYPE = torch.bfloat16


def graph_time_us(fn) -> float:
    fn()   # compile / warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


class Caches:
    """One cache big enough for the largest batch x context; each case takes shuffled blocks."""

    def __init__(self, tokens: int, dtype: torch.dtype, engine_layout: bool = True) -> None:
        """engine_layout: V as the engine lays it out (an fp8 cache's tokens contiguous, kv_layout.py);
        else row by row, as K."""
        self.num_blocks = tokens // BLOCK + 1
        shape = (self.num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.k = torch.empty(shape, dtype=DTYPE, device="cuda").normal_().to(dtype)
        self.v = torch.empty(shape, dtype=DTYPE, device="cuda").normal_().to(dtype)
        if engine_layout and dtype == FP8_DTYPE:
            self.v = v_cache_copy(self.v)

    def tables(self, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        per_seq = -(-context // BLOCK)
        blocks = torch.randperm(self.num_blocks, device="cuda")[:batch * per_seq]
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        return seq_lens, blocks.view(batch, per_seq).int()
