"""A gated MLP's SiLU-mul on the GPU: torch.compile's kernel (what the GPU path ran before)
against the Triton kernel (nanoserve/runner/layers/silu_mul.py), bf16, at the intermediate widths
of Qwen3-0.6B (3,072) and Qwen3-8B (12,288), from one decode row to a 16k-token prefill chunk.

Each time is per call inside a replayed CUDA graph over input copies that together overflow L2
(layers/skinny_choice.py's timer), median of 5. Bandwidth = bytes read + written / time.

    python bench/silu_mul.py [--rows 1,16,256,1024,4096,16384]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nanoserve.runner.layers import ops  # noqa: E402
from nanoserve.runner.layers.silu_mul import silu_mul  # noqa: E402
from nanoserve.runner.layers.skinny_choice import graph_us_per_call, rotated_weights  # noqa: E402

WIDTHS = {"qwen3-0.6b": 3072, "qwen3-8b": 12288}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,256,1024,4096,16384")
    args = parser.parse_args()
    device = torch.device("cuda")
    compiled = torch.compile(ops.silu_mul, fullgraph=True)
    print(f"{'model':<11} {'rows':>6} {'compiled us':>12} {'TB/s':>6} {'triton us':>10} {'TB/s':>6} {'speed-up':>9}")
    for name, width in WIDTHS.items():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = rotated_weights(rows, 2 * width, torch.bfloat16, device)
            want = ops.silu_mul(inputs[0].float())
            for fn in (compiled, silu_mul):   # both must give the float32 result, rounded once
                torch.testing.assert_close(fn(inputs[0]).float(), want, rtol=2**-7, atol=2**-7)
            moved = rows * 3 * width * 2
            times = [graph_us_per_call(fn, inputs, calls=20) for fn in (compiled, silu_mul)]
            rates = [moved / (t * 1e-6) / 1e12 for t in times]
            print(f"{name:<11} {rows:>6} {times[0]:>12.1f} {rates[0]:>6.2f} {times[1]:>10.1f} {rates[1]:>6.2f}"
                  f" {times[0] / times[1]:>8.2f}x")
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
