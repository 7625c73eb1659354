"""What the compiler made of the paged decode kernel: registers, spills, shared memory, and how
many programs fit on one SM, per cache dtype; with --ir DIR it also writes the TTGIR.
Meant to run under Nsight Compute too (one shape, a few launches):

    python scripts/decode_kernel_report.py --dtype fp8 --ir /tmp/ir
    ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python scripts/decode_kernel_report.py --dtype fp8
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nanoserve.runner.attention import triton_decode  # noqa: E402
from nanoserve.runner.attention.fp8 import FP8_DTYPE  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp8"], default="fp8")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--config", default="", help="BLOCK_N,num_warps,num_stages (default: the kernel's)")
    parser.add_argument("--ir", default="", help="folder to write the TTGIR into")
    args = parser.parse_args()
    cache_dtype = FP8_DTYPE if args.dtype == "fp8" else torch.bfloat16
    per_seq = -(-args.context // BLOCK)
    shape = (args.batch * per_seq + 1, BLOCK, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, dtype=torch.bfloat16, device="cuda").to(cache_dtype)
    v = torch.randn(shape, dtype=torch.bfloat16, device="cuda").to(cache_dtype)
    tables = torch.randperm(shape[0], device="cuda")[:args.batch * per_seq].view(args.batch, per_seq).int()
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32, device="cuda")
    q = torch.randn(args.batch, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    config = None
    if args.config:
        block_n, warps, stages = (int(x) for x in args.config.split(","))
        config = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    for _ in range(4):
        triton_decode.paged_decode(q, k, v, seq_lens, tables, HEAD_DIM ** -0.5, args.context, config=config)
    torch.cuda.synchronize()
    props = torch.cuda.get_device_properties(0)
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    for cache in triton_decode._decode_kernel.device_caches.values():
        for key, kernel in cache[0].items():
            warps = kernel.metadata.num_warps
            by_smem = smem_per_sm // max(kernel.metadata.shared, 1)
            by_regs = regs_per_sm // max(kernel.n_regs * 32 * warps, 1)
            print(f"{args.dtype}: warps {warps} stages {kernel.metadata.num_stages} regs {kernel.n_regs} "
                  f"spills {kernel.n_spills} shared {kernel.metadata.shared} B -> programs/SM by smem "
                  f"{by_smem}, by regs {by_regs}")
            if args.ir:
                os.makedirs(args.ir, exist_ok=True)
                with open(os.path.join(args.ir, f"decode-{args.dtype}.ttgir"), "w") as f:
                    f.write(kernel.asm["ttgir"])


if __name__ == "__main__":
    main()
