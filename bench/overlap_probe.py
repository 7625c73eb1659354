"""Can a decode step's GEMMs hide behind its attention? A probe before building two-batch overlap.

A decode layer at a large batch is attention (bound by the KV read) then GEMMs (bound by compute
at 8B). Split the batch in two halves A and B and run, a layer at a time, A's attention beside B's
GEMMs on a second stream, then A's GEMMs beside B's attention. This times, each in one CUDA graph
over `--layers` layers with weights of their own:

    serial: attention(all rows), then the GEMMs(all rows), as the runner does today
    overlap: the two halves as above, joined after each pair
    and the parts alone, to read how much of the smaller one the overlap hid.

    python bench/overlap_probe.py --config bench/configs/qwen3-8b.json --batch 256 --context 1024
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from attention_common import BLOCK, HEAD_DIM, graph_time_us  # noqa: E402

from nanoserve.runner.attention.triton_decode import paged_decode  # noqa: E402

DTYPE = torch.bfloat16


class Layer:
    def __init__(self, cfg: dict, kv_heads: int, num_blocks: int) -> None:
        h, inter, q_heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
        self.q_heads = q_heads
        w = lambda i, o: torch.randn(i, o, dtype=DTYPE, device="cuda") * i ** -0.5  # noqa: E731
        self.qkv, self.o = w(h, (q_heads + 2 * kv_heads) * HEAD_DIM), w(q_heads * HEAD_DIM, h)
        self.gate_up, self.down = w(h, 2 * inter), w(inter, h)
        shape = (num_blocks, BLOCK, kv_heads, HEAD_DIM)
        self.k = torch.randn(shape, dtype=DTYPE, device="cuda")
        self.v = torch.randn(shape, dtype=DTYPE, device="cuda")
        self.inter = inter


class Rows:
    """One half (or the whole) of the batch: its activations, query and block table."""

    def __init__(self, layer: Layer, cfg: dict, rows: int, context: int, first_block: int) -> None:
        per_seq = -(-context // BLOCK)
        self.x = torch.randn(rows, cfg["hidden_size"], dtype=DTYPE, device="cuda")
        self.q = torch.randn(rows, layer.q_heads, HEAD_DIM, dtype=DTYPE, device="cuda")
        self.seq_lens = torch.full((rows,), context, dtype=torch.int32, device="cuda")
        self.tables = (first_block + torch.arange(rows * per_seq, device="cuda")).view(rows, per_seq).int()
        self.context = context


def attention(layer: Layer, rows: Rows) -> None:
    paged_decode(rows.q, layer.k, layer.v, rows.seq_lens, rows.tables, HEAD_DIM ** -0.5, rows.context)


def gemms(layer: Layer, rows: Rows) -> None:
    rows.x @ layer.qkv
    y = rows.q.view(rows.q.shape[0], -1) @ layer.o
    gu = y @ layer.gate_up
    gu[:, :layer.inter] @ layer.down


def beside(main_work, side_work, side: torch.cuda.Stream) -> None:
    """main_work on the current stream and side_work on `side`, joined after both."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        side_work()
    main_work()
    torch.cuda.current_stream().wait_stream(side)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="bench/configs/qwen3-0.6b.json")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)
    kv_heads, half = cfg["num_key_value_heads"], args.batch // 2
    per_seq = -(-args.context // BLOCK)
    layers = [Layer(cfg, kv_heads, args.batch * per_seq) for _ in range(args.layers)]
    whole = [Rows(layer, cfg, args.batch, args.context, 0) for layer in layers]
    a = [Rows(layer, cfg, half, args.context, 0) for layer in layers]
    b = [Rows(layer, cfg, half, args.context, half * per_seq) for layer in layers]
    side = torch.cuda.Stream()
    pairs = list(zip(layers, whole, a, b))

    def serial() -> None:
        for layer, rows, _, _ in pairs:
            attention(layer, rows)
            gemms(layer, rows)

    def overlap() -> None:
        for layer, _, ra, rb in pairs:
            beside(lambda: attention(layer, ra), lambda: gemms(layer, rb), side)
            beside(lambda: gemms(layer, ra), lambda: attention(layer, rb), side)

    def halves_serial() -> None:
        for layer, _, ra, rb in pairs:
            for rows in (ra, rb):
                attention(layer, rows)
                gemms(layer, rows)

    times = {
        "attention, all rows": lambda: [attention(layer, rows) for layer, rows, _, _ in pairs],
        "gemms, all rows": lambda: [gemms(layer, rows) for layer, rows, _, _ in pairs],
        "attention, half rows": lambda: [attention(layer, ra) for layer, _, ra, _ in pairs],
        "gemms, half rows": lambda: [gemms(layer, ra) for layer, _, ra, _ in pairs],
        "serial, all rows": serial,
        "serial, two halves": halves_serial,
        "overlap, two halves": overlap,
    }
    print(f"{torch.cuda.get_device_name()}  {os.path.basename(args.config)}  batch {args.batch}  "
          f"context {args.context}  {args.layers} layers; us a layer")
    for name, fn in times.items():
        print(f"{name:24s} {graph_time_us(fn) / args.layers:9.1f}", flush=True)


if __name__ == "__main__":
    main()
