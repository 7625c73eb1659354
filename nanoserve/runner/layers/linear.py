"""Linear layers whose weight packs several checkpoint tensors (q/k/v, gate/up), and the row-split
output projections of tensor parallelism.

Both run cuBLAS (F.linear) unless the runner found at startup that the skinny Triton kernel
(small_gemm.py) beats it for this weight at this many rows: then `skinny_rows` holds the row
buckets where it does. Past those, `blas_lt_rows` holds the decode-graph batch sizes where
cuBLASLt beat cuBLAS's own pick (blas_choice.py). Both stay empty on the CPU and with enforce_eager."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.runner.parallel import SINGLE, TensorParallel


def row_bucket(rows: int) -> int:
    """The power of two >= rows: the row counts skinny GEMM is timed and configured at."""
    return 1 << (rows - 1).bit_length()


# Skinny GEMM was timed under graph replay and runs only in graphs. Launched eagerly from Python
# (a short prompt's prefill) each call would pay Triton's launch cost, far above cuBLAS's.
_graph_kernels = False


@contextlib.contextmanager
def building_graphs() -> Iterator[None]:
    """Inside: the linear layers may pick the skinny kernel (graph warm-up and capture)."""
    global _graph_kernels
    before, _graph_kernels = _graph_kernels, True
    try:
        yield
    finally:
        _graph_kernels = before


def _skinny_takes(x: torch.Tensor, rows: frozenset[int]) -> bool:
    return _graph_kernels and bool(rows) and x.dim() == 2 and x.shape[0] > 0 and row_bucket(x.shape[0]) in rows


@contextlib.contextmanager
def preferring_cublaslt() -> Iterator[None]:
    """Inside: torch's matmuls go through cuBLASLt rather than cuBLAS (a process-wide setting)."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            skinny_rows: frozenset[int], blas_lt_rows: frozenset[int] = frozenset()) -> torch.Tensor:
    """x W^T (+ bias): while CUDA graphs are being built, the skinny Triton kernel where it won
    at startup for x's rows, or cuBLASLt where it did; else cuBLAS."""
    if _skinny_takes(x, skinny_rows):
        # imported here: Triton loads only where skinny GEMM is on (CUDA)
        from nanoserve.runner.layers.small_gemm import skinny_linear
        return skinny_linear(x, weight, bias)
    if _graph_kernels and x.dim() == 2 and x.shape[0] in blas_lt_rows:
        with preferring_cublaslt():
            return F.linear(x, weight, bias)
    return F.linear(x, weight, bias)


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
        self.skinny_rows: frozenset[int] = frozenset()
        self.blas_lt_rows: frozenset[int] = frozenset()
        # row buckets where the skinny kernel does the RMSNorm before it itself (forward_normed)
        self.normed_rows: frozenset[int] = frozenset()
        self.takes_normed_input = False   # set by a layer that norms right before: the startup choice tries normed_rows

    def load_part(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        total, first, size = self.sources[shard]
        if loaded.shape[0] != total:
            raise ValueError(f"has {loaded.shape[0]} rows, expected {total}")
        start = self.offsets[shard]
        param.data[start:start + size].copy_(loaded[first:first + size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.skinny_rows, self.blas_lt_rows)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(norm(x + residual)), x + residual), or without a residual (forward(norm(x)), x):
        in one kernel in the normed row buckets."""
        if _skinny_takes(x, self.normed_rows):
            from nanoserve.runner.layers.small_gemm import skinny_linear_normed
            return skinny_linear_normed(x, residual, norm.weight, norm.eps, self.weight, self.bias)
        if residual is None:
            return self.forward(norm(x)), x
        x, residual = norm(x, residual)
        return self.forward(x), residual


class RowParallelLinear(nn.Linear):
    """y = x W^T (+ bias) over this rank's slice of the input features, summed over ranks; the bias,
    whole on every rank, is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel = SINGLE, bias: bool = False) -> None:
        self.tp = tp
        self.first, local = tp.split(in_features)
        super().__init__(local, out_features, bias=bias)
        self.weight.weight_loader = self.load
        self.skinny_rows: frozenset[int] = frozenset()
        self.blas_lt_rows: frozenset[int] = frozenset()
        # row buckets where the skinny kernel takes a gated MLP's [gate | up] itself (forward_gated)
        self.gated_rows: frozenset[int] = frozenset()
        self.takes_gated_input = False   # set by a gated MLP: the startup choice then tries gated_rows

    def load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != param.shape[0] or loaded.shape[1] != param.shape[1] * self.tp.size:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected "
                             f"({param.shape[0]}, {param.shape[1] * self.tp.size})")
        param.data.copy_(loaded[:, self.first:self.first + param.shape[1]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(project(x, self.weight, self._local_bias(), self.skinny_rows, self.blas_lt_rows))

    def forward_gated(self, gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """forward(act(gate_up)), act being silu(gate) * up: in one kernel in the gated row buckets."""
        if _skinny_takes(gate_up, self.gated_rows):
            from nanoserve.runner.layers.small_gemm import skinny_linear
            return self._reduce(skinny_linear(gate_up, self.weight, self._local_bias(), gated=True))
        return self.forward(act(gate_up))

    def _local_bias(self) -> torch.Tensor | None:
        """The bias for this rank's product: all of it on one rank; with several it waits for the sum."""
        return self.bias if self.tp.size == 1 else None

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(partial)
        return out + self.bias if self.bias is not None and self.tp.size > 1 else out
