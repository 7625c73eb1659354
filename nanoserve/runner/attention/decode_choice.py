"""Startup choice of how the Triton decode kernel multiplies, timed on this device: tl.dot with
the default tiles, or CUDA cores (CUDA_CORES: float32 sums, a GQA group's rows unpadded, an fp8
tile widened in registers). A CUDA-core variant is taken only where it gives the dot's output,
beats it by MARGIN at a busy server's batch and is no slower at a small one; one that fails to
build or launch is passed over.

Timed as decode runs: replayed from a CUDA graph, over the runner's own cache (layer 0's tensors,
blocks taken at random), at one context.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from nanoserve.runner.attention.triton_decode import paged_decode

logger = logging.getLogger(__name__)

CANDIDATES = (
    dict(CUDA_CORES=True, BLOCK_N=16, num_warps=4, num_stages=2),
    dict(CUDA_CORES=True, BLOCK_N=32, num_warps=4, num_stages=2),
    dict(CUDA_CORES=True, BLOCK_N=64, num_warps=8, num_stages=2),
)
MARGIN = 0.05
SMALL_BATCH = 4    # a variant must also be no slower (within MARGIN) for a lightly loaded server
TOLERANCE = 1e-2   # relative L2 error against the dot's output: both sum in float32


def graph_us(fn: Callable[[], torch.Tensor], config: dict | None = None) -> float:
    """Microseconds per call of fn (running `config`) inside a replayed CUDA graph: the skinny
    GEMM choice's timer."""
    from nanoserve.runner.layers.skinny_choice import graph_us_per_call
    return graph_us_per_call(lambda _: fn(), [None], calls=20)


def _fill_normal(blocks: torch.Tensor, gen: torch.Generator, step: int = 64) -> None:
    """Unit normals into cache blocks of any dtype (e4m3 included), a few blocks at a time."""
    for i in range(0, blocks.shape[0], step):
        part = blocks[i:i + step]
        part.copy_(torch.randn(part.shape, generator=gen, device=part.device))


def choose_decode_config(k_cache: torch.Tensor, v_cache: torch.Tensor, q_heads: int, batch: int,
                         context: int, dtype: torch.dtype,
                         timer: Callable[[Callable[[], torch.Tensor], dict | None], float] = graph_us
                         ) -> dict | None:
    """The CUDA-core config that beats the dot at `batch` sequences of `context` tokens over these
    caches ([blocks, block_size, kv_heads, dim]), and is no slower at SMALL_BATCH of them, or None
    to keep the dot. `timer(fn, config)` gives microseconds per call (tests pass their own)."""
    num_blocks, block_size, _, head_dim = k_cache.shape
    per_seq = -(-context // block_size)
    batch = min(batch, num_blocks // per_seq)
    if batch < 1:
        return None
    gen = torch.Generator(device=k_cache.device).manual_seed(0)
    used = batch * per_seq
    for cache in (k_cache, v_cache):
        _fill_normal(cache[:used], gen)   # a fresh cache holds whatever memory held: NaNs, say
    q = torch.randn(batch, q_heads, head_dim, generator=gen, device=k_cache.device).to(dtype)
    tables = torch.randperm(used, generator=gen, device=k_cache.device).view(batch, per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=k_cache.device)

    def run(config: dict | None, rows: int = batch) -> Callable[[], torch.Tensor]:
        return lambda: paged_decode(q[:rows], k_cache, v_cache, seq_lens[:rows], tables[:rows], head_dim ** -0.5,
                                    context, config=config)

    few = min(batch, SMALL_BATCH)
    want = run(None)().float()
    dot_us, dot_few_us = timer(run(None), None), timer(run(None, few), None)
    best, best_us = None, dot_us
    for config in CANDIDATES:
        try:
            got = run(config)().float()
            agrees = bool((got - want).norm() <= TOLERANCE * want.norm())
            us, few_us = (timer(run(config), config), timer(run(config, few), config)) if agrees else (0.0, 0.0)
        except Exception as exc:   # a Triton build or launch failure on this device: keep looking
            logger.warning("decode attention on CUDA cores %s failed on this device (%s)", config, exc)
            continue
        if not agrees:
            logger.warning("decode attention on CUDA cores %s disagrees with tl.dot on this device", config)
        elif us < (1 - MARGIN) * min(best_us, dot_us) and few_us <= (1 + MARGIN) * dot_few_us:
            best, best_us = config, us
    torch.cuda.empty_cache()   # the timing graphs' pools
    logger.info("decode attention at batch %d, context %d: %s (%.1f us a layer; tl.dot %.1f us)", batch,
                context, "tl.dot" if best is None else f"CUDA cores, BLOCK_N {best['BLOCK_N']}", best_us, dot_us)
    return best
