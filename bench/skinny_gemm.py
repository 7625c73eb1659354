"""Decode-time linear layers on the GPU: cuBLAS (F.linear) against the skinny Triton kernel
(nanoserve/runner/layers/small_gemm.py) at the weight shapes of Qwen3-0.6B and Qwen3-8B, bf16,
1-256 rows (`--rows`). Effective bandwidth = bytes of weight + x + output / time.

Each time is per call inside a replayed CUDA graph of 50 calls over weight copies that together
overflow L2 (layers/skinny_choice.py: what the server's startup choice measures), median of 5.

    python bench/skinny_gemm.py            # one line per shape and row count, then per-step sums
    python bench/skinny_gemm.py --sweep    # plus the best of a grid of tiles per case (minutes)
    python bench/skinny_gemm.py --blas-lt  # plus F.linear with torch's cuBLASLt preference
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nanoserve.runner.layers.ops import compiled_ops  # noqa: E402
from nanoserve.runner.layers.skinny_choice import graph_us_per_call, rotated_weights, same_product  # noqa: E402
from nanoserve.runner.layers.small_gemm import (SkinnyConfig, num_sms, skinny_config,  # noqa: E402
                                                skinny_linear)

MODELS = {   # name: (decoder layers, {projection: (N, K)})
    "qwen3-0.6b": (28, {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024),
                        "down": (1024, 3072)}),
    "qwen3-8b": (36, {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
                      "down": (4096, 12288)}),
}
ROWS = "1,2,4,8,16,64,128,256"
DTYPE = torch.bfloat16


def sweep_configs(rows: int) -> list[SkinnyConfig]:
    if rows > 64:
        return [SkinnyConfig(64, bn, bk, split, warps, stages)
                for bn, bk, split, warps, stages in itertools.product((32, 64, 128), (32, 64, 128), (1, 2, 4),
                                                                      (4, 8), (2, 3, 4))
                if stages * (bn + 64) * bk * 2 <= 160 * 1024]
    if rows <= 2:
        return [SkinnyConfig(rows, bn, bk, split, warps, 2)
                for bn, bk, split, warps in itertools.product((4, 8, 16), (256, 512, 1024, 2048),
                                                              (1, 2, 4), (4, 8))
                if bn * bk * rows <= 16384]
    return [SkinnyConfig(16, bn, bk, split, 4, stages)
            for bn, bk, split, stages in itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4, 8),
                                                           (2, 3, 4))
            if stages * (bn + 16) * bk * 2 <= 160 * 1024]


def big_tile_configs(rows: int) -> list[SkinnyConfig]:
    """Tiles of 64-256 rows a program (the heuristic stops at 64): the weight streams fewer times,
    x is read from L2 by every column block."""
    return [SkinnyConfig(bm, bn, bk, split, warps, stages)
            for bm, bn, bk, split, warps, stages in itertools.product(
                (64, 128, 256), (64, 128, 256), (64, 128), (1, 2, 4), (4, 8), (3, 4))
            if bm <= max(64, rows) and stages * (bn + bm) * bk * 2 <= 200 * 1024
            and bm * bn <= 32 * warps * 128]


def best_of_sweep(x: torch.Tensor, weights: list[torch.Tensor],
                  configs: list[SkinnyConfig] | None = None) -> tuple[float, SkinnyConfig]:
    best = (float("inf"), None)
    for cfg in configs if configs is not None else sweep_configs(x.shape[0]):
        try:
            us = graph_us_per_call(lambda w: skinny_linear(x, w, config=cfg), weights, replays=3)
        except Exception:   # out of shared memory or registers
            continue
        best = min(best, (us, cfg), key=lambda t: t[0])
    return best


def linear_us_with_cublaslt(x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """F.linear's time (graph_us_per_call) while torch prefers cuBLASLt for its matmuls."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return graph_us_per_call(lambda w: F.linear(x, w), weights)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tiles per case")
    parser.add_argument("--rows", default=ROWS, help="comma-separated row counts")
    parser.add_argument("--big-tiles", action="store_true",
                        help="also time tiles of 64-256 rows a program (big_tile_configs) at 64 rows and more")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    parser.add_argument("--blas-lt", action="store_true",
                        help="also time F.linear with torch.backends.cuda.preferred_blas_library('cublaslt')")
    args = parser.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    silu_mul = compiled_ops().silu_mul   # the fused kernel a decode step runs
    device = torch.device("cuda")
    sms = num_sms(device)
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}", flush=True)
    began = time.perf_counter()
    step_us: dict[tuple[str, int], list[float]] = {}
    lt_step_us: dict[tuple[str, int], float] = {}
    for model in args.models.split(","):
        layers, shapes = MODELS[model]
        for proj, (n, k) in shapes.items():
            weights = rotated_weights(n, k, DTYPE, device)
            for rows in row_counts:
                x = torch.randn(rows, k, dtype=DTYPE, device=device)
                nbytes = (n * k + rows * k + rows * n) * 2
                cublas = graph_us_per_call(lambda w: F.linear(x, w), weights)
                triton = graph_us_per_call(lambda w: skinny_linear(x, w), weights)
                cfg = skinny_config(rows, n, k, sms)
                line = (f"{model:10s} {proj:7s} {n:5d}x{k:<5d} M={rows:<3d} "
                        f"cuBLAS {cublas:7.1f} us {nbytes / cublas / 1e6:5.2f} TB/s | "
                        f"triton {triton:7.1f} us {nbytes / triton / 1e6:5.2f} TB/s "
                        f"x{cublas / triton:4.2f} [n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} "
                        f"w{cfg.num_warps} st{cfg.num_stages}]")
                if proj == "down" and rows <= 32:
                    # SiLU-mul inside the kernel (a gated MLP's down): the SiLU-mul launch it saves
                    # is timed beside it
                    gate_up = torch.randn(rows, 2 * k, dtype=DTYPE, device=device)
                    gated = graph_us_per_call(lambda w: skinny_linear(gate_up, w, gated=True), weights)
                    act = graph_us_per_call(lambda _: silu_mul(gate_up), weights)
                    line += f" | gated {gated:7.1f} us (SiLU-mul apart {act:5.1f} us)"
                if args.blas_lt:
                    lt = linear_us_with_cublaslt(x, weights)
                    line += (f" | cuBLASLt {lt:7.1f} us x{cublas / lt:4.2f}; cuBLAS at "
                             f"{2 * rows * n * k / cublas / 1e6:5.1f} TFLOP/s")
                    lt_step_us[model, rows] = lt_step_us.get((model, rows), 0.0) + layers * lt
                if args.sweep:
                    us, best = best_of_sweep(x, weights)
                    line += f" | sweep best {us:7.1f} us {best}"
                if args.big_tiles and rows >= 64:
                    us, best = best_of_sweep(x, weights, big_tile_configs(rows))
                    ok = best is not None and same_product(skinny_linear(x, weights[0], config=best),
                                                           F.linear(x, weights[0]))
                    line += f" | big tiles best {us:7.1f} us x{cublas / us:4.2f} {best} {'ok' if ok else 'WRONG'}"
                print(line, flush=True)
                sums = step_us.setdefault((model, rows), [0.0, 0.0, 0.0])
                sums[0] += layers * cublas
                sums[1] += layers * triton
                sums[2] += layers * min(cublas, triton)   # what the startup choice would run
            del weights
    for (model, rows), (cublas, triton, chosen) in step_us.items():
        print(f"{model} M={rows}: linears per decode step: cuBLAS {cublas:7.1f} us, Triton "
              f"{triton:7.1f} us, per-shape best {chosen:7.1f} us")
    for (model, rows), lt in lt_step_us.items():
        print(f"{model} M={rows}: linears per decode step with cuBLASLt preferred: {lt:7.1f} us")
    print(f"done in {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
