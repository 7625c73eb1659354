"""The cuBLASLt choice's wiring, on the CPU: which batch sizes it times, which layers it points
at them, and that a layer takes cuBLASLt exactly at those row counts while graphs are built
(tests/gpu/test_small_gemm_gpu.py times it and replays it on the GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.runner.cuda_graph import graph_batch_sizes
from nanoserve.runner.layers import linear
from nanoserve.runner.layers.blas_choice import enable_blas_lt, lt_row_counts
from nanoserve.runner.layers.linear import PackedLinear, RowParallelLinear, building_graphs


def test_the_batch_sizes_timed_are_the_decode_graphs_past_the_skinny_rows() -> None:
    assert lt_row_counts(graph_batch_sizes(256)) == list(range(48, 257, 16))
    assert lt_row_counts(graph_batch_sizes(100)) == [48, 64, 80, 96, 100]
    assert lt_row_counts(graph_batch_sizes(32)) == []


def test_layers_take_cublaslt_at_their_batch_sizes_while_graphs_are_built(monkeypatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(PackedLinear(64, {"a": (32, 0, 32)}, bias=True), RowParallelLinear(32, 64))
    assert enable_blas_lt(model, {(32, 64, 48), (32, 64, 80), (64, 16, 48)}) == 1
    packed, row = model
    assert packed.blas_lt_rows == {48, 80} and row.blas_lt_rows == frozenset()

    preferred = ["cublas"]   # the process-wide setting, as torch.backends.cuda keeps it

    def preferred_blas_library(backend: str | None = None) -> str:
        if backend is not None:
            preferred[0] = backend
        return preferred[0]

    seen, plain = [], F.linear
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred_blas_library)
    monkeypatch.setattr(linear.F, "linear", lambda x, *args: seen.append((x.shape[0], preferred[0])) or plain(x, *args))
    packed(torch.randn(48, 64))   # an eager step: no graphs being built
    with building_graphs():
        for rows in (47, 48, 64, 80):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(packed(x), plain(x, packed.weight, packed.bias))
        row(torch.randn(48, 32))
    assert seen == [(48, "cublas"), (47, "cublas"), (48, "cublaslt"), (64, "cublas"), (80, "cublaslt"),
                    (48, "cublas")]
    assert preferred == ["cublas"], "the setting must come back after each call"
