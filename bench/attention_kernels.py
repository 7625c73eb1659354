"""Decode-attention micro-benchmark on the GPU: the KV bandwidth the Triton decode kernel achieves
(bytes of K+V read / time), flash-attn's where it imports, and the device-to-device copy
bandwidth (bytes read + written / time) as the ceiling.

Workload: Qwen3-0.6B attention (16 q heads, 8 kv heads, head dim 128, bf16), block size 256,
every sequence at the full context, physical blocks shuffled. Each call is captured in a CUDA
graph (as the runner replays decode) and timed with triton.testing.do_bench (median, L2 flushed).

    python bench/attention_kernels.py            # the table
    python bench/attention_kernels.py --tiles --splits   # plus tile and split-count sweeps
    python bench/attention_kernels.py --kv-cache-dtype fp8   # an e4m3 cache (no flash-attn column)
    python bench/attention_kernels.py --prefill-sweep --group 2   # prefill tiles for lone prompts
    python bench/attention_kernels.py --ragged   # unequal contexts: split counts and launch order
    python bench/attention_kernels.py --prefill-order   # prefill programs longest first, heads side by side
    python bench/attention_kernels.py --launch-order   # a sequence's kv heads side by side, or head by head
    python bench/attention_kernels.py --ahead   # each tile's block read a tile ahead, or per key
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from attention_common import (DTYPE, HEAD_DIM, KV_HEADS, Caches, copy_bandwidth,  # noqa: E402
                              graph_time_us)
from decode_sweeps import ahead_sweep, launch_order_sweep, ragged_sweep, v_layout_sweep  # noqa: E402

from nanoserve.runner.attention.decode_splits import num_decode_splits  # noqa: E402
from nanoserve.runner.attention.fp8 import FP8_DTYPE  # noqa: E402
from nanoserve.runner.attention.kv_layout import v_cache_copy  # noqa: E402
from nanoserve.runner.attention.triton_decode import paged_decode  # noqa: E402
from nanoserve.runner.attention.triton_prefill import paged_prefill, prefill_tiles  # noqa: E402

Q_HEADS = 16   # --group sets it
BATCHES, CONTEXTS = (1, 16, 256), (1024, 8192, 32768)

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:
    flash_attn_with_kvcache = flash_attn_varlen_func = None


def decode_case(caches: Caches, batch: int, context: int, **kw) -> float:
    seq_lens, tables = caches.tables(batch, context)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    return graph_time_us(lambda: paged_decode(q, caches.k, caches.v, seq_lens, tables,
                                              HEAD_DIM ** -0.5, context, **kw))


def flash_decode_case(caches: Caches, batch: int, context: int) -> float:
    seq_lens, tables = caches.tables(batch, context)
    q = torch.randn(batch, 1, Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    return graph_time_us(lambda: flash_attn_with_kvcache(
        q, caches.k, caches.v, cache_seqlens=seq_lens, block_table=tables,
        softmax_scale=HEAD_DIM ** -0.5, causal=True))


def kv_bytes(batch: int, context: int, caches: Caches) -> int:
    return 2 * batch * context * KV_HEADS * HEAD_DIM * caches.k.element_size()


def prompts(caches: Caches, lens: list[int]) -> tuple:
    """(seq_lens, tables, query starts, q, causal FLOPs of QK^T + PV) of fresh prompts of `lens`
    tokens, over shuffled blocks of `caches`."""
    _, tables = caches.tables(len(lens), max(lens))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device="cuda")
    cu[1:] = seq_lens.cumsum(0)
    q = torch.randn(sum(lens), Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    return seq_lens, tables, cu, q, sum(4 * (n * (n + 1) / 2) * Q_HEADS * HEAD_DIM for n in lens)


def prefill_line(caches: Caches, seqs: int = 16, prompt: int = 1024) -> str:
    seq_lens, tables, cu, q, flops = prompts(caches, [prompt] * seqs)
    us = graph_time_us(lambda: paged_prefill(q, caches.k, caches.v, cu, seq_lens, tables,
                                             HEAD_DIM ** -0.5, prompt))
    line = f"prefill {seqs}x{prompt} causal: triton {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s"
    if flash_attn_varlen_func is not None and caches.k.dtype == DTYPE:
        us = graph_time_us(lambda: flash_attn_varlen_func(
            q, caches.k, caches.v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=prompt,
            max_seqlen_k=prompt, softmax_scale=HEAD_DIM ** -0.5, causal=True,
            block_table=tables))
        line += f" | flash_attn {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s"
    return line


def mixed_lines(caches: Caches) -> list[str]:
    """A mixed step (decode rows at context 1k beside one fresh prompt), as the engine runs it
    today, all rows through the prefill kernel, against the decode rows through the decode kernel
    and the prompt alone through the prefill kernel: what splitting mixed steps would gain."""
    lines = []
    for decodes, prompt in ((32, 512), (128, 512), (256, 512), (256, 2048)):
        context = 1024
        seq_lens, tables = caches.tables(decodes + 1, max(context, prompt))
        seq_lens[:decodes] = context
        seq_lens[decodes] = prompt
        q_lens = torch.ones(decodes + 1, dtype=torch.int32, device="cuda")
        q_lens[decodes] = prompt
        cu = torch.zeros(decodes + 2, dtype=torch.int32, device="cuda")
        cu[1:] = q_lens.cumsum(0)
        q = torch.randn(decodes + prompt, Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        q_dec, q_pre = q[:decodes], q[decodes:]
        cu_pre = torch.tensor([0, prompt], dtype=torch.int32, device="cuda")

        def one() -> torch.Tensor:
            return paged_prefill(q, caches.k, caches.v, cu, seq_lens, tables, HEAD_DIM ** -0.5, prompt)

        def two() -> torch.Tensor:
            return torch.cat([
                paged_decode(q_dec, caches.k, caches.v, seq_lens[:decodes], tables[:decodes], HEAD_DIM ** -0.5, context),
                paged_prefill(q_pre, caches.k, caches.v, cu_pre, seq_lens[decodes:], tables[decodes:],
                              HEAD_DIM ** -0.5, prompt)])

        err = (one().float() - two().float()).abs().max().item()
        lines.append(f"mixed {decodes} decodes x {context} + 1 prompt of {prompt}: one prefill launch "
                     f"{graph_time_us(one):8.1f} us, decode + prefill launches {graph_time_us(two):8.1f} us"
                     f"{'  ! outputs differ by more than 2e-2' if err > 2e-2 else ''}")
    return lines


def prefill_layouts() -> None:
    """Prefill over an fp8 cache with V row by row (its default tiles), then along tokens
    (kv_layout.py) on a few tiles: TFLOP/s for lone and batched prompts, and each output's largest
    difference from the row-by-row one."""
    rows = Caches(4 * 4096, FP8_DTYPE, engine_layout=False)
    tokens = v_cache_copy(rows.v)
    configs = [("rows, default", rows.v, None)] + [
        (f"tokens {m} x {n}, {w} warps, {st} stages", tokens, dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st))
        for m, n, w, st in ((64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2))]
    for seqs, prompt in ((1, 1024), (4, 1024), (1, 4096)):
        seq_lens, tables, cu, q, flops = prompts(rows, [prompt] * seqs)
        want = None
        for label, v, config in configs:
            def run(v=v, config=config) -> torch.Tensor:
                return paged_prefill(q, rows.k, v, cu, seq_lens, tables, HEAD_DIM ** -0.5, prompt, config=config)
            try:
                got = run().float()
                want = got if want is None else want
                print(f"fp8 prefill {seqs}x{prompt}, V {label}: {flops / graph_time_us(run) / 1e6:6.1f} TFLOP/s; "
                      f"largest difference {(got - want).abs().max().item():.2e}", flush=True)
            except Exception as e:   # out of registers or shared memory
                print(f"fp8 prefill {seqs}x{prompt}, V {label}: failed: {type(e).__name__}: {str(e)[:80]}", flush=True)


def prefill_sweep(caches: Caches) -> None:
    """Prefill tiles for lone prompts (a lightly loaded server's TTFT): TFLOP/s by config, each
    checked against the default config's output."""
    cases = [(1, 1024), (4, 1024), (1, 4096), (1, 16384)]
    inputs = []
    for seqs, prompt in cases:
        seq_lens, tables, cu, q, flops = prompts(caches, [prompt] * seqs)
        run = (lambda q=q, cu=cu, seq_lens=seq_lens, tables=tables, prompt=prompt, **cfg:
               paged_prefill(q, caches.k, caches.v, cu, seq_lens, tables, HEAD_DIM ** -0.5, prompt, **cfg))
        inputs.append((run, run(), flops))
    print(f"\nprefill sweep, {Q_HEADS} q heads (TFLOP/s): BLOCK_M / BLOCK_N / warps / stages / last tiles first")
    print("config             " + "".join(f"  {s}x{p:<9}" for s, p in cases))
    for block_m in (64, 128):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    for last_first in (False, True):
                        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                                   LAST_TILES_FIRST=last_first)
                        name = f"{block_m:4d} {block_n:4d} {warps} {stages} {'L' if last_first else '-'}"
                        try:
                            cells = []
                            for run, expected, flops in inputs:
                                err = (run(config=cfg).float() - expected.float()).abs().max().item()
                                us = graph_time_us(lambda: run(config=cfg))
                                cells.append(f"  {flops / us / 1e6:9.1f}{'!' if err > 2e-2 else ' '}")
                        except Exception as e:   # out of shared memory or registers
                            print(f"{name}     failed: {type(e).__name__}")
                            continue
                        print(f"{name}     " + "".join(cells))
    print("! = differs from the default config by more than 2e-2")


def tile_sweep(caches: Caches, block_ns: tuple[int, ...] = (32, 64, 128)) -> None:
    """Decode tiles by config, each config's output checked against the default config's. An fp8
    cache needs its own sweep: widening e4m3 to f16 adds work and registers per tile."""
    print(f"\ntile sweep (us), {caches.k.dtype} cache, {Q_HEADS} q heads: BLOCK_N / num_warps / num_stages")
    cases = [(256, 1024), (256, 8192), (16, 8192), (16, 1024)]
    print("config          " + "".join(f"  b{b:<4}c{c:<6}" for b, c in cases))
    q = torch.randn(16, Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    seq_lens, tables = caches.tables(16, 2048)
    expected = paged_decode(q, caches.k, caches.v, seq_lens, tables, HEAD_DIM ** -0.5, 2048)
    for block_n in block_ns:
        for warps in (1, 2, 4, 8):
            for stages in (1, 2, 3):
                cfg = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
                name = f"{block_n:4d} {warps} {stages}"
                try:
                    got = paged_decode(q, caches.k, caches.v, seq_lens, tables, HEAD_DIM ** -0.5, 2048, config=cfg)
                    err = (got.float() - expected.float()).abs().max().item()
                    times = [decode_case(caches, b, c, config=cfg) for b, c in cases]
                except Exception as e:   # out of shared memory or registers
                    print(f"{name}  failed: {type(e).__name__}")
                    continue
                print(f"{name}       " + "".join(f"  {t:11.1f}" for t in times) + ("  !" if err > 2e-2 else ""))
    print("! = differs from the default config by more than 2e-2")


def split_sweep(caches: Caches) -> None:
    print("\nsplit sweep (us); * = the heuristic's choice")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, context in ((1, 1024), (4, 1024), (16, 1024), (32, 1024), (64, 1024), (1, 4096), (1, 8192),
                           (1, 32768), (16, 8192), (16, 32768), (32, 4096), (64, 4096)):
        chosen = num_decode_splits(batch, KV_HEADS, context, sms, caches.k.element_size() == 1)
        row = []
        for splits in sorted({1, 2, 4, 8, 16, 32, 64, chosen}):
            t = decode_case(caches, batch, context, num_splits=splits)
            row.append(f"{splits}{'*' if splits == chosen else ''}:{t:.1f}")
        print(f"batch {batch:3d} ctx {context:5d}  " + "  ".join(row))


def prefill_order_sweep(caches: Caches) -> None:
    """Prefill programs from a staged list (as a captured step runs them): the list in sequence and
    tile order or longest first, launched head by head or a tile's kv heads side by side, for a few
    tile configs. TFLOP/s; each output checked against the untiled default's."""
    rng = np.random.default_rng(0)
    cases = {"1x1k": [1024], "1x2k": [2048], "1x4k": [4096], "1x16k": [16384], "4x1k": [1024] * 4,
             "16x100-1k": rng.integers(100, 1025, 16).tolist(), "1x512": [512]}
    configs = [(128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2)]
    group = Q_HEADS // KV_HEADS
    print(f"\nprefill launch order, {Q_HEADS} q heads (TFLOP/s): BLOCK_M / BLOCK_N / warps / stages, "
          "list order (t: sequence and tile, L: longest first), heads (o: outer, f: a tile's side by side)")
    print("config            " + "".join(f"{name:>11}" for name in cases))
    inputs = []
    for lens in cases.values():
        seq_lens, tables, cu, q, flops = prompts(caches, lens)
        expected = paged_prefill(q, caches.k, caches.v, cu, seq_lens, tables, HEAD_DIM ** -0.5, max(lens))
        inputs.append((lens, q, cu, seq_lens, tables, expected, flops))
    for block_m, block_n, warps, stages in configs:
        block_q = max(block_m, group) // group
        for order, heads in (("t", "o"), ("t", "f"), ("L", "o"), ("L", "f")):
            cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                       HEADS_FAST=heads == "f")
            cells = []
            for lens, q, cu, seq_lens, tables, expected, flops in inputs:
                host = np.empty(sum(-(-n // block_q) for n in lens) + len(lens), dtype=np.int32)
                count = prefill_tiles(lens, block_q, host, np.asarray(lens) if order == "L" else None)
                tiles = torch.from_numpy(host[:count]).cuda()
                run = (lambda q=q, cu=cu, seq_lens=seq_lens, tables=tables, tiles=tiles, n=max(lens):
                       paged_prefill(q, caches.k, caches.v, cu, seq_lens, tables, HEAD_DIM ** -0.5, n,
                                     config=cfg, tiles=tiles))
                try:
                    err = (run().float() - expected.float()).abs().max().item()
                    cells.append(f"{flops / graph_time_us(run) / 1e6:10.1f}{'!' if err > 2e-2 else ' '}")
                except Exception as e:   # out of shared memory or registers
                    cells.append(f"{type(e).__name__[:10]:>11}")
            print(f"{block_m:4d} {block_n:4d} {warps} {stages} {order} {heads}     " + "".join(cells), flush=True)
    print("! = differs from the untiled default by more than 2e-2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", action="store_true", help="also sweep the decode tile config")
    parser.add_argument("--splits", action="store_true", help="also sweep split counts")
    parser.add_argument("--ragged", action="store_true",
                        help="only sweep splits and launch order over unequal contexts (no table)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="fp8: an e4m3 cache (bytes and bandwidth count one byte per element)")
    parser.add_argument("--fp8-sweep", action="store_true",
                        help="only sweep an e4m3 cache's tiles (no table)")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="only sweep the prefill kernel's tiles for lone prompts (no table)")
    parser.add_argument("--prefill-order", action="store_true",
                        help="only weigh prefill launch orders (longest first, heads side by side) by tile config")
    parser.add_argument("--launch-order", action="store_true",
                        help="only weigh a sequence's kv heads side by side against head by head (no table)")
    parser.add_argument("--ahead", action="store_true",
                        help="only weigh reading each tile's block a tile ahead against per key (no table)")
    parser.add_argument("--v-layout", action="store_true",
                        help="only weigh an fp8 cache's V row by row against along tokens, with its prefill (no table)")
    parser.add_argument("--group", type=int, default=2, help="q heads per kv head (Qwen3-0.6B 2, 8B 4)")
    args = parser.parse_args()
    global Q_HEADS
    Q_HEADS = KV_HEADS * args.group
    if args.fp8_sweep:
        tile_sweep(Caches(256 * 8192, FP8_DTYPE), block_ns=(16, 32, 64, 128, 256))
        return
    if args.prefill_sweep:
        prefill_sweep(Caches(4 * 16384 * 2, DTYPE))
        return
    if args.prefill_order:
        prefill_order_sweep(Caches(4 * 16384 * 2, DTYPE))
        return
    if args.ragged:
        ragged_sweep(Q_HEADS)
        return
    if args.launch_order:
        launch_order_sweep(Q_HEADS)
        return
    if args.ahead:
        ahead_sweep(Q_HEADS)
        return
    if args.v_layout:
        v_layout_sweep(Q_HEADS)
        prefill_layouts()
        return
    fp8 = args.kv_cache_dtype == "fp8"
    flash = flash_attn_with_kvcache is not None and not fp8   # flash-attn reads no fp8 cache
    props = torch.cuda.get_device_properties(0)
    copy = copy_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs; device copy {copy / 1e12:.2f} TB/s "
          f"(read + write)")
    caches = Caches(max(BATCHES) * max(CONTEXTS), FP8_DTYPE if fp8 else DTYPE)
    print(f"KV cache {caches.k.dtype}")
    print(f"{'batch':>5} {'context':>7} {'splits':>6} {'triton us':>10} {'TB/s':>6} {'%copy':>6}"
          + (f" {'flash us':>9} {'TB/s':>6} {'%copy':>6}" if flash else ""))
    summary = []
    for batch in BATCHES:
        for context in CONTEXTS:
            splits = num_decode_splits(batch, KV_HEADS, context, props.multi_processor_count, fp8)
            us = decode_case(caches, batch, context)
            bw = kv_bytes(batch, context, caches) / (us * 1e-6)
            line = (f"{batch:5d} {context:7d} {splits:6d} {us:10.1f} {bw / 1e12:6.2f} "
                    f"{bw / copy:6.0%}")
            if flash:
                fus = flash_decode_case(caches, batch, context)
                fbw = kv_bytes(batch, context, caches) / (fus * 1e-6)
                line += f" {fus:9.1f} {fbw / 1e12:6.2f} {fbw / copy:6.0%}"
            print(line)
            if batch == 256 and context <= 8192:
                summary.append(bw / copy)
    print(prefill_line(caches))
    print("\n".join(mixed_lines(caches)))
    if args.tiles:
        tile_sweep(caches)
    if args.splits:
        split_sweep(caches)
    print(f"summary: triton decode ({args.kv_cache_dtype} cache) at batch 256, context 1k-8k: "
          f"{min(summary):.0%}-{max(summary):.0%} of the copy bandwidth ({copy / 1e12:.2f} TB/s)")


if __name__ == "__main__":
    main()
