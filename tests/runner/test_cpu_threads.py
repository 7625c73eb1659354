"""torch's CPU threads: shared among tensor-parallel ranks, a core kept for the server's front end."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
import nanoserve.cpu_threads
from nanoserve.cpu_threads import cgroup_cpu_limit, cpu_compute_threads


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(nanoserve.cpu_threads, "cgroup_cpu_limit", lambda: None)


@pytest.mark.parametrize("tp, reserved, threads", [(1, 0, None), (1, 1, 7), (2, 1, 3), (4, 0, 2), (16, 1, 1)])
def test_threads_are_torchs_default_less_the_reserve_shared_among_ranks(eight_cores, tp, reserved, threads):
    assert cpu_compute_threads(tp, reserved) == threads


@pytest.mark.parametrize("tp, reserved, threads", [(1, 0, 3), (1, 1, 2), (2, 1, 1)])
def test_a_container_quota_below_the_core_count_bounds_the_threads(eight_cores, monkeypatch, tp, reserved, threads):
    monkeypatch.setattr(nanoserve.cpu_threads, "cgroup_cpu_limit", lambda: 3)
    assert cpu_compute_threads(tp, reserved) == threads


@pytest.mark.parametrize("files, limit", [
    ({"cpu.max": "250000 100000\n"}, 3),          # v2, --cpus 2.5
    ({"cpu.max": "max 100000\n"}, None),          # v2, no quota
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2),   # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu.max": "1000 100000\n"}, 1),            # a sliver of a CPU is still one thread
    ({}, None),
])
def test_the_cgroup_quota_is_read_in_cpus(tmp_path, files, limit):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_limit(str(tmp_path)) == limit


def test_omp_num_threads_set_by_the_user_stands(eight_cores, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cpu_compute_threads(2, reserved=1) is None


def test_serve_keeps_a_core_for_its_front_end(monkeypatch):
    import nanoserve.server.app
    from nanoserve.cli import main

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(nanoserve.cpu_threads, "cgroup_cpu_limit", lambda: None)
    served = []
    monkeypatch.setattr(nanoserve.server.app, "serve", lambda config, *args: served.append(config) or args[-1].close())
    main(["serve", "--device", "cpu", "--host", "127.0.0.1", "--port", "0"])
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
