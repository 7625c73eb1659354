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
from nanoserve.runner.layers.skinny_choice import (MARGIN, MAX_CHOICE_ROWS, describe, faster_than_cublas,
                                                   shape_rows, skinny_layers)

logger = logging.getLogger(__name__)


def lt_row_counts(graph_sizes: Iterable[int]) -> list[int]:
    """The batch sizes to time: the decode graphs' past the rows the skinny choice covers."""
    return sorted(rows for rows in set(graph_sizes) if rows > MAX_CHOICE_ROWS)


def lt_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    with preferring_cublaslt():
        return F.linear(x, weight)


def choose_blas_lt(weight_shapes: Iterable[tuple[int, int]], row_counts: Iterable[int], device: torch.device,
                   dtype: torch.dtype, margin: float = MARGIN) -> set[tuple[int, int, int]]:
    """The (N, K, rows) where cuBLASLt gives F.linear's result and beats cuBLAS by `margin` on
    this device."""
    return faster_than_cublas("cuBLASLt", lt_linear, weight_shapes, row_counts, device, dtype, margin)


def enable_blas_lt(model: nn.Module, wins: set[tuple[int, int, int]]) -> int:
    """Point each linear layer at its weight shape's cuBLASLt batch sizes; how many got any."""
    enabled = 0
    for layer in skinny_layers(model):
        n, k = layer.weight.shape
        layer.blas_lt_rows = shape_rows(wins, n, k)
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
