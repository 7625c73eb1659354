"""PDL is GPU-only: off on the CPU whatever NANOSERVE_PDL says,
where the kernels then run (under the interpreter) with no launch option Triton would not know."""

from __future__ import annotations

import torch

from nanoserve.runner import pdl


def test_pdl_stays_off_on_the_cpu(monkeypatch) -> None:
    cpu = torch.device("cpu")
    for value in (None, "0", "1"):
        if value is None:
            monkeypatch.delenv("NANOSERVE_PDL", raising=False)
        else:
            monkeypatch.setenv("NANOSERVE_PDL", value)
        pdl.pdl_enabled.cache_clear()
        assert pdl.pdl_launch(cpu) == {"USE_PDL": False}
    pdl.pdl_enabled.cache_clear()


def test_pdl_is_on_by_default_where_the_gpu_has_it(monkeypatch) -> None:
    gpu = torch.device("cuda")
    for capability, value, on in (((9, 0), None, True), ((9, 0), "1", True), ((9, 0), "0", False),
                                  ((8, 0), None, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        if value is None:
            monkeypatch.delenv("NANOSERVE_PDL", raising=False)
        else:
            monkeypatch.setenv("NANOSERVE_PDL", value)
        pdl.pdl_enabled.cache_clear()
        assert pdl.pdl_enabled(gpu) == on, (capability, value)
    pdl.pdl_enabled.cache_clear()
