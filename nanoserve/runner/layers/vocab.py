"""Token embedding and LM head split over tensor-parallel ranks by vocabulary rows.

Each rank holds an equal slice of the (padded) vocabulary. A lookup zeroes the ids outside the
slice and sums over ranks; the logits of each slice are gathered into the whole row. Without
tensor parallelism both are a plain embedding and linear layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoserve.runner.parallel import SINGLE, TensorParallel

# torch 2.13 renamed all_gather_into_tensor (the old name warns); older releases have only that one
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.first, self.rows = tp.split(vocab_size)  # the last rank's tail is padding
        self.weight = nn.Parameter(torch.empty(self.rows, dim))
        self.weight.weight_loader = self.load

    def load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected "
                             f"({self.vocab_size}, {param.shape[1]})")
        mine = loaded[self.first:self.first + self.rows]
        param.data[:len(mine)].copy_(mine)
        param.data[len(mine):].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.first) & (ids < self.first + self.rows)
        out = F.embedding((ids - self.first) * mine, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the whole vocabulary from each rank's slice of the output projection."""

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None:
            if self.tp.size > 1:
                raise ValueError("logits into a given buffer need the whole vocabulary on one rank")
            return torch.mm(hidden, self.weight.t(), out=out)
        logits = F.linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits
        rows, local = logits.shape
        slices = torch.empty((self.tp.size * rows, local), dtype=logits.dtype, device=logits.device)
        _all_gather(slices, logits.contiguous())  # rank-major: [ranks * rows, local]
        return slices.view(self.tp.size, rows, local).permute(1, 0, 2).reshape(rows, -1)[:, :self.vocab_size]
