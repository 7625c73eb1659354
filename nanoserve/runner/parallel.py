"""Tensor parallelism: which shard of each layer a rank holds, and the collectives between ranks.

Rank 0 runs the engine and its runner; ranks 1..N-1 are worker processes that run the same model
forward on their shards. Attention heads and MLP columns are split across ranks, and the output
projections sum their partial results with one all-reduce each. The embedding and LM head are
split by vocabulary rows (layers/vocab.py); every rank gathers the logits, and rank 0 samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    control: object = field(default=None, compare=False)  # gloo group for the step broadcasts

    def split(self, total: int) -> tuple[int, int]:
        """(start, size) of this rank's share of `total` rows; when `size` does not divide `total`
        (a vocabulary), every share is rounded up and the last rank's runs past the end."""
        local = -(-total // self.size)
        return self.rank * local, local

    def split_heads(self, heads: int) -> tuple[int, int]:
        """(first head, head count) on this rank; with fewer heads than ranks, ranks share copies."""
        return self.rank * heads // self.size, max(1, heads // self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (pickled, over the CPU control group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())


SINGLE = TensorParallel()


def init_process_group(rank: int, size: int, init_method: str, device: str) -> TensorParallel:
    """Join the group of `size` ranks; NCCL between GPUs, gloo on the CPU."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return TensorParallel(rank, size, control)
