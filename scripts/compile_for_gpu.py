"""Compile the attention kernels for a CUDA target without a GPU (Triton's own compiler and the
ptxas it ships): what the CPU tests' interpreter lets pass but the GPU compiler would refuse
shows here, before a device run.

    python scripts/compile_for_gpu.py            # sm90 (H100/H200), every variant below
    python scripts/compile_for_gpu.py --arch 80 --only decode,merge
    python scripts/compile_for_gpu.py --only "decode fp8" --byte-loads   # one-byte loads in the SASS

Each kernel is compiled with the tiles the engine picks on that GPU, over a bf16 and an fp8
cache, with its flags all off and all on (splits, launch order, mixed steps' packed rows, PDL, an fp8
cache's V along tokens, the first tile's L2 prefetch, a sliding window), and the skinny GEMM's row paths.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the interpreter compiles nothing")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nanoserve.runner.attention.decode_tiles import decode_config  # noqa: E402
from nanoserve.runner.attention.triton_decode import _decode_kernel, _merge_splits_kernel  # noqa: E402
from nanoserve.runner.attention.prefill_splits import _merge_kernel  # noqa: E402
from nanoserve.runner.attention.triton_prefill import _prefill_config, _prefill_kernel  # noqa: E402
from nanoserve.runner.layers.rms_norm_kernel import _rms_norm_kernel  # noqa: E402
from nanoserve.runner.layers.small_gemm import _skinny_kernel, skinny_config  # noqa: E402

FLOATS = {"scale_log2", "v_scale", "eps", "norm_eps", "inv_k_scale", "inv_v_scale"}
CUDA = torch.device("cuda")


def signature(kernel, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Triton types of the kernel's arguments: pointers by name, the softmax scales as float32,
    every other runtime argument an int32."""
    return {name: "constexpr" if name in constexprs else pointers.get(name, "fp32" if name in FLOATS else "i32")
            for name in kernel.arg_names}


# the strides of q, the caches and the output: multiples of 16 elements in every engine launch
ALIGNED_STRIDES = {"stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt",
                   "stride_vh", "stride_vd", "stride_ot", "stride_oh"}


def compile_one(kernel, pointers: dict[str, str], constexprs: dict, options: dict, target: GPUTarget):
    """The kernel compiled as a launch over the engine's tensors shows it to Triton: every pointer
    and the strides above divisible by 16 (those equal to 1 are among the constexprs), which is
    what lets loads go 16 bytes at a time."""
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if name not in constexprs and (name in pointers or name in ALIGNED_STRIDES)}
    source = ASTSource(fn=kernel, signature=signature(kernel, pointers, constexprs),
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    return triton.compile(source, target=target, options=options)


def _cuobjdump(compiled, flag: str) -> str:
    """cuobjdump's output (as shipped with Triton) for the compiled kernel's cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([tool, flag, cubin.name], capture_output=True, text=True, check=True).stdout


def byte_loads(compiled) -> int:
    """Global and shared-memory loads of one byte in the compiled kernel's SASS."""
    return len(re.findall(r"\b(?:LDG|LDS)(?:\.E)?\.U8\b", _cuobjdump(compiled, "-sass")))


def resources(compiled, num_warps: int) -> str:
    """Registers a thread, stack bytes, shared memory, and the programs an SM that these allow on
    Hopper (65,536 registers, 228 KB of shared memory, 64 warps an SM)."""
    usage = _cuobjdump(compiled, "--dump-resource-usage")
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    shared = compiled.metadata.shared
    fits = min(64 // num_warps, 65536 // (regs * 32 * num_warps), 228 * 1024 // max(shared, 1))
    return f"{regs} registers, {stack} bytes of stack, {shared // 1024} KB shared: {fits} programs an SM"


def variants(target: GPUTarget):
    """(name, kernel, pointer types, constexprs, launch options) of every variant compiled."""
    for fp8 in (False, True):
        cache = "*fp8e4nv" if fp8 else "*bf16"
        io = dict(q_ptr="*bf16", out_ptr="*bf16", k_cache_ptr=cache, v_cache_ptr=cache, part_acc_ptr="*fp32",
                  part_lse_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32", seq_order_ptr="*i32",
                  query_start_ptr="*i32", query_start_loc_ptr="*i32", tiles_ptr="*i32", cos_ptr="*fp32",
                  sin_ptr="*fp32", q_norm_ptr="*bf16", k_norm_ptr="*bf16", new_v_ptr="*bf16", ranges_ptr="*i32",
                  part_stats_ptr="*fp32")
        for on in (False, True):
            flags = dict(SPLIT=on, ORDERED=on, PACKED_Q=on, USE_PDL=on and target.arch >= 90)
            # strides of 1 are specialized at launch: the lengths', and V's along tokens or dims
            unit = dict(stride_sl=1, **({"stride_vt": 1} if fp8 and on else {"stride_vd": 1}))
            shared = dict(GROUP=2, HEAD_DIM=128, BLOCK_SIZE=256, PRECISION=None, KV_FP8=fp8, FP8_VIA_F16=fp8,
                          V_TOKENS_CONTIGUOUS=fp8 and on, NEW_V=False, SECTOR=32, WINDOW=0, **flags, **unit)
            tiles = decode_config(CUDA, fp8, v_tokens_contiguous=on)
            options = dict(num_warps=tiles.pop("num_warps"), num_stages=tiles.pop("num_stages"))
            yield (f"decode {cache[1:]} flags {'on' if on else 'off'}", _decode_kernel, io,
                   dict(shared, BLOCK_H=16, HEADS_FAST=on, PREFETCH_LINES=(1 if fp8 else 2) if on else 0, **tiles),
                   options)
            if on:   # a decode-only step's: q, k and v made from the packed projection in the kernel
                yield (f"decode {cache[1:]} rope", _decode_kernel, io,
                       dict(shared, PACKED_Q=False, BLOCK_H=16, HEADS_FAST=on, PREFETCH_LINES=0 if fp8 else 2,
                            ROPE=True, NORM=True, Q_HEADS=16, **tiles), options)
            if on:   # a sliding-window layer's (Mistral's 4,096 keys)
                yield (f"decode {cache[1:]} window", _decode_kernel, io,
                       dict(shared, BLOCK_H=16, HEADS_FAST=on, PREFETCH_LINES=(1 if fp8 else 2), **tiles, WINDOW=4096),
                       options)
            if on and fp8:   # a larger decode-only step's: each row's new v stored by the kernel, sector by sector
                yield (f"decode {cache[1:]} new v", _decode_kernel, io,
                       dict(shared, PACKED_Q=False, BLOCK_H=16, HEADS_FAST=on, PREFETCH_LINES=0, NEW_V=True,
                            **tiles), options)
            tiles = _prefill_config(128, torch.bfloat16, CUDA)
            options = dict(num_warps=tiles.pop("num_warps"), num_stages=tiles.pop("num_stages"))
            prefill = dict(GROUP=2, BLOCK_Q=tiles["BLOCK_M"] // 2, HEAD_DIM=128, BLOCK_SIZE=256, PRECISION=None,
                           KV_FP8=fp8, LAST_TILES_FIRST=on, SKIP_DECODE_ROWS=on, TILED=on,
                           V_TOKENS_CONTIGUOUS=fp8 and on, USE_PDL=flags["USE_PDL"], WINDOW=0, SPLIT=on,
                           HEADS_FAST=on, stride_qsl=1, **unit, **tiles)
            yield f"prefill {cache[1:]} flags {'on' if on else 'off'}", _prefill_kernel, io, prefill, options
            if on:
                yield (f"prefill {cache[1:]} window", _prefill_kernel, io, dict(prefill, WINDOW=4096, SPLIT=False),
                       options)
                yield (f"prefill {cache[1:]} parts' merge", _merge_kernel,
                       dict(merges_ptr="*i32", query_start_loc_ptr="*i32", acc_ptr="*fp32",
                            stats_ptr="*fp32", out_ptr="*bf16"),
                       dict(GROUP=2, BLOCK_Q=tiles["BLOCK_M"] // 2, BLOCK_M=tiles["BLOCK_M"], HEAD_DIM=128, KV_FP8=fp8,
                            USE_PDL=flags["USE_PDL"]), dict(num_warps=8, num_stages=1))
    for packed, window in ((False, 0), (True, 0), (True, 4096)):
        yield (f"merge packed {packed}{' window' if window else ''}", _merge_splits_kernel,
               dict(part_acc_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", seq_lens_ptr="*i32",
                    query_start_ptr="*i32"),
               dict(Q_HEADS=16, BLOCK_HEADS=4, HEAD_DIM=128, SPLITS_POW2=4, BLOCK_N=64, PACKED_Q=packed,
                    USE_PDL=target.arch >= 90, WINDOW=window), dict(num_warps=4, num_stages=1))
    # the skinny GEMM's CUDA-core rows (plain, normed, gated) and one tl.dot bucket, 0.6B's qkv and down
    # (16 rows of `down` split K: its last split sums the partials)
    bf16 = {name: "*bf16" for name in ("x_ptr", "w_ptr", "bias_ptr", "out_ptr", "sum_ptr", "res_ptr", "gamma_ptr",
                                       "new_res_ptr")}
    bf16["counts_ptr"] = "*i32"
    for rows, n, k, kind in ((1, 4096, 1024, "normed"), (2, 4096, 1024, "normed"), (1, 1024, 3072, "gated"),
                             (2, 1024, 2048, "plain"), (16, 4096, 1024, "plain"), (16, 1024, 3072, "plain")):
        cfg = skinny_config(rows, n, k, 132)
        for preload in (False, True):
            pointers = {**bf16, "out_ptr": "*fp32"} if cfg.split_k > 1 else bf16   # split: the float32 partials
            yield (f"skinny {rows} rows {kind} split {cfg.split_k} preload {preload}", _skinny_kernel, pointers,
                   dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
                        SPLIT=cfg.split_k > 1, HAS_BIAS=False, PRECISION=None, GATED=kind == "gated",
                        NORMED=kind == "normed", HAS_RES=kind == "normed", USE_PDL=target.arch >= 90, PRELOAD=preload,
                        SPLIT_K=cfg.split_k, SUM_IN_LAST=cfg.split_k > 1),
                   dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    for has_res in (False, True):
        yield (f"rms_norm residual {has_res}", _rms_norm_kernel,
               {name: "*bf16" for name in ("x_ptr", "res_ptr", "new_res_ptr", "gamma_ptr", "out_ptr")},
               dict(HAS_RES=has_res, BLOCK=1024, USE_PDL=target.arch >= 90), dict(num_warps=4, num_stages=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    parser.add_argument("--only", default="", help="comma-separated words: only variants whose name starts with one")
    parser.add_argument("--byte-loads", action="store_true", help="also count each variant's one-byte loads (SASS)")
    parser.add_argument("--resources", action="store_true",
                        help="also print each variant's registers, stack, shared memory and programs an SM")
    parser.add_argument("--maxnreg", type=int, help="compile with this cap on registers a thread")
    args = parser.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    only = tuple(word for word in args.only.split(",") if word)
    count = 0
    for name, kernel, pointers, constexprs, options in variants(target):
        if only and not name.startswith(only):
            continue
        started = time.perf_counter()
        if args.maxnreg:
            options = dict(options, maxnreg=args.maxnreg)
        compiled = compile_one(kernel, pointers, constexprs, options, target)
        loads = f", {byte_loads(compiled)} one-byte loads" if args.byte_loads else ""
        used = f"; {resources(compiled, options['num_warps'])}" if args.resources else ""
        print(f"sm{args.arch} {name}: compiled in {time.perf_counter() - started:.1f} s{loads}{used}", flush=True)
        count += 1
    print(f"{count} kernels compiled for sm{args.arch}")


if __name__ == "__main__":
    main()
