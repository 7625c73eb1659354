"""Linear layers whose weight packs several checkpoint tensors (q/k/v, gate/up)."""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Linear):
    """One matmul for several projections; the loader fills each part by its shard name."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in parts.items():
            self.offsets[name] = (start, size)
            start += size
        for param in self.parameters():
            param.weight_loader = self.load_part

    def load_part(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        start, size = self.offsets[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"checkpoint shard {shard!r} has {loaded.shape[0]} rows, expected {size}")
        param.data[start:start + size].copy_(loaded)
