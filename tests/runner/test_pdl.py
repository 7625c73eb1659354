"""PDL is opt-in and GPU-only: off without NANOSERVE_PDL=1, and off on the CPU whatever it says,
where the kernels then run (under the interpreter) with no launch option Triton would not know."""

from __future__ import annotations

import torch

from nanoserve.runner import pdl


def test_pdl_stays_off_unless_asked_for_on_a_gpu_that_has_it(monkeypatch) -> None:
    cpu = torch.device("cpu")
    for value in (None, "0", "1"):
        if value is None:
            monkeypatch.delenv("NANOSERVE_PDL", raising=False)
        else:
            monkeypatch.setenv("NANOSERVE_PDL", value)
        pdl.pdl_enabled.cache_clear()
        assert pdl.pdl_launch(cpu) == {"USE_PDL": False}
    pdl.pdl_enabled.cache_clear()
