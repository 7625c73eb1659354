"""Startup choice, per linear weight shape and decode-graph batch size past the skinny kernel's
rows, between cuBLAS as torch picks it and cuBLASLt: cuBLASLt only where it measured faster.

Neither wins everywhere. On an H200 (BENCHMARKS.md, `gpu_suite.sh gemm-lt`) the Qwen3-8B `down`
projection (4096 x 12288) took 56.4 us at 192 rows through cuBLAS and 42.7 through cuBLASLt,
yet 32.8 against 36.3 at 128 rows. Over the 8B workload this choice gained 0.7% (11,391 ->
11,466 tok/s warm); it costs a few seconds at startup (4.9 s for 8B at 512 sequences). Timed as
the skinny choice times (skinny_choice.py): graph replay over weight copies that overflow L2,
cuBLASLt ahead by MARGIN, and giving cuBLAS's product.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.runner.layers.linear import preferring_cublaslt
from nanoserve.runner.layers.skinny_choice import (MARGIN, MAX_CHOICE_ROWS, describe, graph_us_per_call,
                                                   rotated_weights, same_product, skinny_layers)

logger = logging.getLogger(__name__)


def lt_row_counts(graph_sizes: Iterable[int]) -> list[int]:
    """The batch sizes to time: the decode graphs' past the rows the skinny choice covers."""
    return sorted(rows for rows in set(graph_sizes) if rows > MAX_CHOICE_ROWS)


def lt_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    with preferring_cublaslt():
        return F.linear(x, weight)


@torch.inference_mode()
def choose_blas_lt(weight_shapes: Iterable[tuple[int, int]], row_counts: Iterable[int], device: torch.device,
                   dtype: torch.dtype, margin: float = MARGIN) -> set[tuple[int, int, int]]:
    """The (N, K, rows) where cuBLASLt gives F.linear's result and beats cuBLAS by `margin` on
    this device. A failure of cuBLASLt there counts as a loss."""
    wins = set()
    row_counts = sorted(set(row_counts))
    for n, k in sorted(set(weight_shapes)):
        weights = rotated_weights(n, k, dtype, device) if row_counts else []
        for rows in row_counts:
            x = torch.randn(rows, k, dtype=dtype, device=device)
            try:
                if not same_product(lt_linear(x, weights[0]), F.linear(x, weights[0])):
                    logger.warning("cuBLASLt disagrees with cuBLAS at %dx%d, %d rows: cuBLAS kept there", n, k, rows)
                    continue
                lt = graph_us_per_call(lambda w: lt_linear(x, w), weights)
            except Exception as exc:  # a cuBLASLt error on this device: no reason to stop
                logger.warning("cuBLASLt failed at %dx%d, %d rows (%s): cuBLAS kept there", n, k, rows, exc)
                torch.cuda.synchronize()
                continue
            cublas = graph_us_per_call(lambda w: F.linear(x, w), weights)
            logger.debug("%dx%d rows %d: cuBLAS %.1f us, cuBLASLt %.1f us", n, k, rows, cublas, lt)
            if lt < (1 - margin) * cublas:
                wins.add((n, k, rows))
        weights = []   # freed before the next shape's copies (and before empty_cache below)
    torch.cuda.empty_cache()
    return wins


def enable_blas_lt(model: nn.Module, wins: set[tuple[int, int, int]]) -> int:
    """Point each linear layer at its weight shape's cuBLASLt batch sizes; how many got any."""
    enabled = 0
    for layer in skinny_layers(model):
        n, k = layer.weight.shape
        layer.blas_lt_rows = frozenset(rows for wn, wk, rows in wins if (wn, wk) == (n, k))
        enabled += bool(layer.blas_lt_rows)
    return enabled


def use_blas_lt_where_faster(model: nn.Module, graph_sizes: Iterable[int], device: torch.device) -> None:
    """Time, choose and enable cuBLASLt for `model`'s linear layers at the decode graphs' batch
    sizes (captured after this); one log line."""
    layers = skinny_layers(model)
    rows = lt_row_counts(graph_sizes)
    if not layers or not rows:
        return
    start = time.perf_counter()
    wins = choose_blas_lt({tuple(layer.weight.shape) for layer in layers}, rows, device, layers[0].weight.dtype)
    enabled = enable_blas_lt(model, wins)
    logger.info("cuBLASLt for %s (%d of %d linear layers), cuBLAS elsewhere past %d rows; chosen in %.1f s",
                describe(wins), enabled, len(layers), MAX_CHOICE_ROWS, time.perf_counter() - start)
