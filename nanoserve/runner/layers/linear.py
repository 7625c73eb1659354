"""Linear layers whose weight packs several checkpoint tensors (q/k/v, gate/up), and the row-split
output projections of tensor parallelism."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.runner.parallel import SINGLE, TensorParallel


class PackedLinear(nn.Linear):
    """One matmul for several projections; the loader fills each part by its shard name.

    `parts` maps a shard name to (rows in the checkpoint, first row held here, rows held here):
    all of a tensor without tensor parallelism, this rank's heads or columns with it."""

    def __init__(self, in_features: int, parts: dict[str, tuple[int, int, int]], bias: bool = False) -> None:
        super().__init__(in_features, sum(size for _, _, size in parts.values()), bias=bias)
        self.sources = parts
        self.offsets: dict[str, int] = {}
        start = 0
        for name, (_, _, size) in parts.items():
            self.offsets[name] = start
            start += size
        for param in self.parameters():
            param.weight_loader = self.load_part

    def load_part(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        total, first, size = self.sources[shard]
        if loaded.shape[0] != total:
            raise ValueError(f"checkpoint shard {shard!r} has {loaded.shape[0]} rows, expected {total}")
        start = self.offsets[shard]
        param.data[start:start + size].copy_(loaded[first:first + size])


class RowParallelLinear(nn.Linear):
    """y = x W^T over this rank's slice of the input features, summed over ranks (no bias)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel = SINGLE) -> None:
        self.tp = tp
        self.first, local = tp.split(in_features)
        super().__init__(local, out_features, bias=False)
        self.weight.weight_loader = self.load

    def load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != param.shape[0] or loaded.shape[1] != param.shape[1] * self.tp.size:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected "
                             f"({param.shape[0]}, {param.shape[1] * self.tp.size})")
        param.data.copy_(loaded[:, self.first:self.first + param.shape[1]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))
