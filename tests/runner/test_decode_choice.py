"""The startup choice between tl.dot and CUDA cores for decode attention, under the Triton
interpreter with timings given by the test: a variant is taken only if it agrees with the dot and
beats it by the margin; one that fails or disagrees is passed over; the cache's old contents
(NaNs here) do not matter."""

from __future__ import annotations

import pytest
import torch

from nanoserve.runner.attention import decode_choice
from nanoserve.runner.attention.decode_choice import CANDIDATES, choose_decode_config

if torch.cuda.is_available():
    pytest.skip("the interpreter's version of this check; the GPU runs the real one at startup",
                allow_module_level=True)


def caches(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    # 12 blocks of 16 tokens, 2 kv heads, head dim 16, filled with NaN: what a fresh cache may hold
    return (torch.full((12, 16, 2, 16), float("nan")).to(dtype), torch.full((12, 16, 2, 16), float("nan")).to(dtype))


def timer_from(times: dict[int | None, float], small: dict[int | None, float] | None = None):
    """Microseconds by BLOCK_N of the CUDA-core config (None: the dot); `small` at the small
    batch, which is timed right after the full one (the same as `times` when not given)."""
    calls = []

    def timer(fn, config):
        key = None if config is None else config["BLOCK_N"]
        calls.append(key)
        at_small = calls.count(key) % 2 == 0
        return (small or times)[key] if at_small else times[key]

    return timer


def choose(times, k_cache=None, v_cache=None, small=None):
    k, v = caches() if k_cache is None else (k_cache, v_cache)
    return choose_decode_config(k, v, q_heads=4, batch=6, context=40, dtype=torch.float32,
                                timer=timer_from(times, small))


def test_the_fastest_variant_that_agrees_and_beats_the_margin_is_taken():
    assert choose({None: 100.0, 16: 90.0, 32: 70.0, 64: 80.0}) == CANDIDATES[1]
    assert choose({None: 100.0, 16: 96.0, 32: 97.0, 64: 99.0}) is None   # within the margin: the dot stays
    assert choose({None: 100.0, 16: 120.0, 32: 130.0, 64: 101.0}) is None
    # faster for a busy server, slower for a light one: the dot stays, unless another is not
    small = {None: 10.0, 16: 10.4, 32: 12.0, 64: 11.0}
    assert choose({None: 100.0, 16: 90.0, 32: 70.0, 64: 80.0}, small=small) == CANDIDATES[0]
    assert choose({None: 100.0, 16: 99.0, 32: 70.0, 64: 80.0}, small=small) is None


def test_a_variant_that_fails_or_disagrees_is_passed_over(monkeypatch):
    real = decode_choice.paged_decode

    def flawed(*args, config=None, **kw):
        if config is not None and config["BLOCK_N"] == 16:
            raise RuntimeError("out of resources")
        out = real(*args, config=config, **kw)
        return out + 1.0 if config is not None and config["BLOCK_N"] == 32 else out

    monkeypatch.setattr(decode_choice, "paged_decode", flawed)
    assert choose({None: 100.0, 16: 10.0, 32: 20.0, 64: 80.0}) == CANDIDATES[2]
    assert choose({None: 100.0, 16: 10.0, 32: 20.0, 64: 99.0}) is None


def test_an_fp8_cache_and_a_cache_too_small_for_the_batch():
    from nanoserve.runner.attention.fp8 import FP8_DTYPE

    k, v = caches(FP8_DTYPE)
    assert choose({None: 100.0, 16: 50.0, 32: 60.0, 64: 70.0}, k, v) == CANDIDATES[0]
    tiny = torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16)   # 40 tokens need 3 blocks
    assert choose({None: 100.0, 16: 50.0, 32: 60.0, 64: 70.0}, *tiny) is None
