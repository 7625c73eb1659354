"""torch's CPU threads: shared among tensor-parallel ranks, a core kept for the server's front end."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.cpu_threads import cpu_compute_threads


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)


@pytest.mark.parametrize("tp, reserved, threads", [(1, 0, None), (1, 1, 7), (2, 1, 3), (4, 0, 2), (16, 1, 1)])
def test_threads_are_torchs_default_less_the_reserve_shared_among_ranks(eight_cores, tp, reserved, threads):
    assert cpu_compute_threads(tp, reserved) == threads


def test_omp_num_threads_set_by_the_user_stands(eight_cores, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cpu_compute_threads(2, reserved=1) is None


def test_serve_keeps_a_core_for_its_front_end(monkeypatch):
    import nanoserve.server.app
    from nanoserve.cli import main

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    served = []
    monkeypatch.setattr(nanoserve.server.app, "serve", lambda config, *args: served.append(config))
    main(["serve", "--device", "cpu"])
    assert served[0].cpu_threads == max(1, torch.get_num_threads() - 1)


def test_the_runner_computes_on_the_configured_threads():
    before = torch.get_num_threads()
    try:
        llm = LLM(config=EngineConfig(device="cpu", cpu_threads=1, num_kvcache_blocks=128))
        assert torch.get_num_threads() == 1
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 4
    finally:
        torch.set_num_threads(before)


def test_zero_threads_are_refused():
    with pytest.raises(ValueError, match="cpu_threads must be at least 1"):
        EngineConfig(device="cpu", cpu_threads=0)
