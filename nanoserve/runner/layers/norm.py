"""RMSNorm, with the residual add fused in front of it."""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.runner.layers.ops import EAGER_OPS, LayerOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, ops: LayerOps = EAGER_OPS) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
