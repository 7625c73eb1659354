"""Startup choice, per linear weight shape and row bucket, between cuBLAS and the skinny Triton
kernel (small_gemm.py): Triton only where it measured faster, so it can never cost speed.

Both run the way decode runs them: CUDA-graph replay, which pays kernel time and the gaps
between kernels (the split-K sum kernel's included) but no Python launch cost. Each graph calls
the layer over copies of the weight that together overflow L2, as a model's layers do; timing one
weight over and over would measure L2, not HBM. Triton must win by MARGIN: a near tie is noise.
`faster_than_cublas` times any alternative this way (blas_choice.py's cuBLASLt too).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.runner.layers import ops
from nanoserve.runner.layers.linear import PackedLinear, RowParallelLinear, row_bucket

logger = logging.getLogger(__name__)

MARGIN = 0.05
MAX_CHOICE_ROWS = 32   # past this cuBLAS tiles fill the device well on their own
CALLS = 50             # calls per timed graph
REPLAYS = 5            # timed replays; their median counts
ROTATION_L2S = 2       # the weight copies of one timing add up to this many L2 caches


def row_buckets(max_rows: int) -> list[int]:
    top = row_bucket(min(max(max_rows, 1), MAX_CHOICE_ROWS))
    return [1 << i for i in range(top.bit_length())]


def rotated_weights(n: int, k: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Copies of an [n, k] weight that together overflow L2 (one when it alone does)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    size = n * k * torch.finfo(dtype).bits // 8
    copies = max(1, min(64, -(-ROTATION_L2S * l2 // size)))
    return [torch.randn(n, k, dtype=dtype, device=device) for _ in range(copies)]


def graph_us_per_call(fn: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor],
                      calls: int = CALLS, replays: int = REPLAYS) -> float:
    """Microseconds per fn(weight) inside a replayed CUDA graph of `calls` calls that cycle
    through `weights`; the median of `replays` replays."""
    fn(weights[0])   # compiles and warms up outside the capture
    torch.cuda.synchronize()
    calls = max(calls, len(weights))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / calls


def agrees_with_cublas(skinny: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                       weight: torch.Tensor, tolerance: float = 2**-6) -> bool:
    """skinny(x, weight) equals F.linear's result within `tolerance` of its largest value.

    Both sum in float32 and round once, so they differ by an output rounding (2^-8 relative in
    bf16); a kernel that reads a wrong tile is off by the size of the output itself. Checked on the
    device at startup, for each kernel variant the runner would use there."""
    return same_product(skinny(x, weight), F.linear(x, weight), tolerance)


def same_product(got: torch.Tensor, want: torch.Tensor, tolerance: float = 2**-6) -> bool:
    """got equals want within `tolerance` of want's largest value (see agrees_with_cublas)."""
    got, want = got.float(), want.float()
    return bool((got - want).abs().max() <= tolerance * want.abs().max())


@torch.inference_mode()
def faster_than_cublas(name: str, product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       weight_shapes: Iterable[tuple[int, int]], row_counts: Iterable[int], device: torch.device,
                       dtype: torch.dtype, margin: float = MARGIN) -> set[tuple[int, int, int]]:
    """The (N, K, rows) where product(x, weight) gives F.linear's result and beats it by `margin`
    on this device. A failure of `product` there (a build or launch error) counts as a loss."""
    wins = set()
    row_counts = sorted(set(row_counts))
    for n, k in sorted(set(weight_shapes)):
        weights = rotated_weights(n, k, dtype, device) if row_counts else []
        for rows in row_counts:
            x = torch.randn(rows, k, dtype=dtype, device=device)
            try:
                if not agrees_with_cublas(product, x, weights[0]):
                    logger.warning("%s disagrees with cuBLAS at %dx%d, %d rows, on this device: cuBLAS kept there",
                                   name, n, k, rows)
                    continue
                alternative = graph_us_per_call(lambda w: product(x, w), weights)
            except Exception as exc:  # an error of the alternative on this device: no reason to stop
                logger.warning("%s failed at %dx%d, %d rows, on this device (%s): cuBLAS kept there",
                               name, n, k, rows, exc)
                torch.cuda.synchronize()
                continue
            cublas = graph_us_per_call(lambda w: F.linear(x, w), weights)
            logger.debug("%dx%d rows %d: cuBLAS %.1f us, %s %.1f us", n, k, rows, cublas, name, alternative)
            if alternative < (1 - margin) * cublas:
                wins.add((n, k, rows))
        weights = []   # freed before the next shape's copies (and before empty_cache below)
    torch.cuda.empty_cache()   # the copies and graph pools: give them back before sizing the KV cache
    return wins


def choose_skinny(weight_shapes: Iterable[tuple[int, int]], max_rows: int, device: torch.device,
                  dtype: torch.dtype, margin: float = MARGIN) -> set[tuple[int, int, int]]:
    """The (N, K, row bucket) where skinny_linear gives F.linear's result and beats it by `margin`
    on this device."""
    from nanoserve.runner.layers.small_gemm import skinny_linear

    return faster_than_cublas("skinny GEMM", skinny_linear, weight_shapes, row_buckets(max_rows), device, dtype,
                              margin)


def fused_beats_apart(what: str, n: int, k: int, rows: int, weights: list[torch.Tensor], agrees: Callable[[], bool],
                      fused: Callable[[torch.Tensor], torch.Tensor], apart: Callable[[torch.Tensor], torch.Tensor]
                      ) -> bool:
    """Whether a fused skinny kernel gives the unfused result and takes less time than the kernels
    it replaces, timed together in one graph. A failure on the device counts as a loss."""
    try:
        if not agrees():
            logger.warning("%s skinny GEMM disagrees with the unfused path at %dx%d, %d rows: kept apart there",
                           what, n, k, rows)
            return False
        fused_us, apart_us = graph_us_per_call(fused, weights), graph_us_per_call(apart, weights)
    except Exception as exc:  # a Triton build or launch failure on this device
        logger.warning("%s skinny GEMM failed at %dx%d, %d rows (%s): kept apart there", what, n, k, rows, exc)
        torch.cuda.synchronize()
        return False
    logger.debug("%dx%d rows %d %s: %.1f us, apart %.1f us", n, k, rows, what, fused_us, apart_us)
    return fused_us < apart_us


@torch.inference_mode()
def choose_gated(wins: set[tuple[int, int, int]], gated_shapes: Iterable[tuple[int, int]], device: torch.device,
                 dtype: torch.dtype, silu_mul: Callable[[torch.Tensor], torch.Tensor] = ops.silu_mul
                 ) -> set[tuple[int, int, int]]:
    """Of the skinny wins of a gated MLP's `down` shapes, those where the kernel that computes
    silu(gate) * up as it loads gives the unfused result and takes less time than the SiLU-mul
    kernel and the plain skinny GEMM it replaces, timed together in one graph (`silu_mul`: the
    model's own, compiled where it runs compiled)."""
    from nanoserve.runner.layers.small_gemm import skinny_linear

    chosen = set()
    for n, k in sorted(set(gated_shapes)):
        won = sorted(shape_rows(wins, n, k))
        weights = rotated_weights(n, k, dtype, device) if won else []
        for rows in won:
            gate_up = torch.randn(rows, 2 * k, dtype=dtype, device=device)
            gate, up = gate_up.float().chunk(2, dim=-1)
            x = (F.silu(gate) * up).to(dtype)   # what the separate SiLU-mul kernel hands the GEMM
            if fused_beats_apart("gated", n, k, rows, weights,
                                 lambda: same_product(skinny_linear(gate_up, weights[0], gated=True),
                                                      F.linear(x, weights[0])),
                                 lambda w: skinny_linear(gate_up, w, gated=True),
                                 lambda w: skinny_linear(silu_mul(gate_up), w)):
                chosen.add((n, k, rows))
        weights = []   # freed before the next shape's copies (and before empty_cache below)
    torch.cuda.empty_cache()
    return chosen


NORMED_ROWS = (1, 2)   # the row buckets whose tiles can fold a norm in (small_gemm.py)


@torch.inference_mode()
def choose_normed(wins: set[tuple[int, int, int]], normed_shapes: Iterable[tuple[int, int]], device: torch.device,
                  dtype: torch.dtype, add_rms_norm: Callable = ops.add_rms_norm, eps: float = 1e-6
                  ) -> set[tuple[int, int, int]]:
    """The (N, K, row bucket) of projections that follow an RMSNorm where the skinny kernel that
    adds the residual and norms as it loads gives the unfused result (the same new residual, bit
    for bit) and takes less time than the norm kernel and the GEMM that runs without it (skinny
    where it won, else cuBLAS), timed together in one graph (`add_rms_norm`: the model's own)."""
    from nanoserve.runner.layers.small_gemm import skinny_linear, skinny_linear_normed

    chosen = set()
    for n, k in sorted(set(normed_shapes)):
        weights = rotated_weights(n, k, dtype, device)
        gamma = torch.rand(k, dtype=dtype, device=device) + 0.5
        for rows in NORMED_ROWS:
            x, residual = (torch.randn(rows, k, dtype=dtype, device=device) for _ in range(2))
            normed, summed = ops.add_rms_norm(x, residual, gamma, eps)

            def gemm(h: torch.Tensor, w: torch.Tensor, rows: int = rows) -> torch.Tensor:
                return skinny_linear(h, w) if (n, k, rows) in wins else F.linear(h, w)

            def agrees() -> bool:
                out, new_residual = skinny_linear_normed(x, residual, gamma, eps, weights[0])
                return torch.equal(new_residual, summed) and same_product(out, F.linear(normed, weights[0]))

            if fused_beats_apart("normed", n, k, rows, weights, agrees,
                                 lambda w: skinny_linear_normed(x, residual, gamma, eps, w)[0],
                                 lambda w: gemm(add_rms_norm(x, residual, gamma, eps)[0], w)):
                chosen.add((n, k, rows))
        weights = []   # freed before the next shape's copies (and before empty_cache below)
    torch.cuda.empty_cache()
    return chosen


def skinny_layers(model: nn.Module) -> list[PackedLinear | RowParallelLinear]:
    return [m for m in model.modules() if isinstance(m, (PackedLinear, RowParallelLinear))]


def shape_rows(chosen: set[tuple[int, int, int]], n: int, k: int) -> frozenset[int]:
    """The rows chosen for weight shape N x K, out of (N, K, rows) triples."""
    return frozenset(rows for wn, wk, rows in chosen if (wn, wk) == (n, k))


def enable_skinny_gemm(model: nn.Module, wins: set[tuple[int, int, int]],
                       gated: set[tuple[int, int, int]] = frozenset(),
                       normed: set[tuple[int, int, int]] = frozenset()) -> int:
    """Point each linear layer at its weight shape's winning row buckets (a gated MLP's `down` at
    its gated ones, a projection after a norm at its normed ones); how many got any."""
    enabled = 0
    for layer in skinny_layers(model):
        n, k = layer.weight.shape
        layer.skinny_rows = shape_rows(wins, n, k)
        if getattr(layer, "takes_gated_input", False):
            layer.gated_rows = shape_rows(gated, n, k) & layer.skinny_rows
        if getattr(layer, "takes_normed_input", False):
            layer.normed_rows = shape_rows(normed, n, k)
        enabled += bool(layer.skinny_rows or getattr(layer, "normed_rows", None))
    return enabled


def describe(wins: set[tuple[int, int, int]]) -> str:
    """'4096x1024 at rows 1,2,4; 1024x2048 at rows 1' (N x K of each weight shape)."""
    rows: dict[tuple[int, int], list[int]] = {}
    for n, k, r in sorted(wins):
        rows.setdefault((n, k), []).append(r)
    return "; ".join(f"{n}x{k} at rows {','.join(map(str, r))}" for (n, k), r in rows.items()) or "no shape"


def use_skinny_gemm_where_faster(model: nn.Module, max_rows: int, device: torch.device,
                                 silu_mul: Callable[[torch.Tensor], torch.Tensor] = ops.silu_mul,
                                 add_rms_norm: Callable = ops.add_rms_norm) -> None:
    """Time, choose and enable skinny GEMM for `model`'s linear layers; one log line. `silu_mul`
    and `add_rms_norm`: the ones the model runs, which the fused GEMMs must beat together with
    the plain one."""
    layers = skinny_layers(model)
    if not layers:
        return
    start = time.perf_counter()
    shapes = {tuple(layer.weight.shape) for layer in layers}
    dtype = layers[0].weight.dtype
    wins = choose_skinny(shapes, max_rows, device, dtype)
    gated_shapes = {tuple(layer.weight.shape) for layer in layers if getattr(layer, "takes_gated_input", False)}
    gated = choose_gated(wins, gated_shapes, device, dtype, silu_mul)
    normed_shapes = {tuple(layer.weight.shape) for layer in layers if getattr(layer, "takes_normed_input", False)}
    normed = choose_normed(wins, normed_shapes, device, dtype, add_rms_norm)
    enabled = enable_skinny_gemm(model, wins, gated, normed)
    logger.info("skinny GEMM: Triton for %s (%d of %d linear layers), cuBLAS elsewhere; SiLU-mul "
                "inside it for %s; RMSNorm inside it for %s; chosen in %.1f s", describe(wins), enabled,
                len(layers), describe(gated), describe(normed), time.perf_counter() - start)
