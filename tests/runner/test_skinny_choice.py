"""The startup choice's timing behind a norm (skinny_choice.after_a_norm): each timed GEMM, the
skinny kernel's and cuBLAS's alike, takes the norm's output, as a step's GEMMs take the output of
the kernel ahead of them. On the CPU the graph timing is replaced by a recorder."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.runner.layers import ops, skinny_choice


def test_the_norm_ahead_gives_the_models_norm_and_makes_one_gamma_a_width() -> None:
    calls = []

    def rms_norm(x, gamma, eps):
        calls.append(gamma)
        return ops.rms_norm(x, gamma, eps)

    ahead = skinny_choice.after_a_norm(rms_norm)
    x = torch.randn(3, 64)
    torch.testing.assert_close(ahead(x), ops.rms_norm(x, torch.ones(64), 1e-6))
    ahead(torch.randn(5, 64))
    ahead(torch.randn(2, 32))
    assert calls[0] is calls[1] and calls[2].shape == (32,)


def test_each_timed_gemm_takes_the_output_of_the_kernel_ahead(monkeypatch) -> None:
    fed: list[torch.Tensor] = []
    times = iter([1.0, 2.0])   # the alternative, then cuBLAS: the alternative wins

    def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        fed.append(x)
        return F.linear(x, w)

    def timed(fn, weights, calls=50, replays=5):
        fn(weights[0])
        return next(times)

    monkeypatch.setattr(skinny_choice, "graph_us_per_call", timed)
    monkeypatch.setattr(skinny_choice, "rotated_weights", lambda n, k, dtype, device: [torch.randn(n, k)])
    doubled = lambda x: 2 * x  # noqa: E731
    wins = skinny_choice.faster_than_cublas("test", product, [(16, 32)], [4], torch.device("cpu"), torch.float32,
                                            ahead=doubled)
    assert wins == {(16, 32, 4)}
    checked, timed_input = fed   # the agreement check takes x itself, the timing the kernel ahead's output
    torch.testing.assert_close(timed_input, 2 * checked)
