"""Attention backends behind one interface:
forward(q, k, v, k_cache, v_cache, meta, scale, k_scale=1.0, v_scale=1.0), the scales applying
only to an fp8 cache (attention/fp8.py). A backend with `fuses_kv_store` also offers
qkv_rope_store (q/k norm + rotary + K/V store in one kernel) and attend (forward without the store).

torch (reference, CPU), triton (our kernels, CUDA or the Triton interpreter), flash_attn (when
the package imports). Kernel modules import lazily: importing this package loads no Triton.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from nanoserve.defaults import FP8_FLASH_ATTN_REFUSAL
from nanoserve.runner.attention.torch_backend import TorchBackend

__all__ = ["TorchBackend", "select_backend"]

BACKENDS = ("auto", "flash_attn", "triton", "torch")


def _flash_attn_imports() -> bool:
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        import flash_attn  # noqa: F401  (its CUDA extension can fail to load)
    except Exception:
        return False
    return True


FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)


def select_backend(name: str, device: str, block_size: int, kv_cache_dtype: str = "auto",
                   dtype: torch.dtype = torch.bfloat16):
    """The attention backend for `name` on `device` ("cpu", "cuda", "cuda:1", ...), computing in `dtype`.

    auto: flash_attn when it imports, the device is CUDA, block_size is a multiple of 256,
    the model computes in fp16 or bf16 and the KV cache is not fp8; else triton on CUDA and
    torch on the CPU.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    on_cuda = device.startswith("cuda")
    fp8 = kv_cache_dtype == "fp8"
    if name == "auto":
        if (on_cuda and block_size % 256 == 0 and not fp8 and dtype in FLASH_ATTN_DTYPES
                and _flash_attn_imports()):
            name = "flash_attn"
        else:
            name = "triton" if on_cuda else "torch"
    if name == "torch":
        return TorchBackend()
    if name == "flash_attn":
        if fp8:
            raise ValueError(FP8_FLASH_ATTN_REFUSAL)
        if not on_cuda:
            raise ValueError(f"the flash_attn backend needs a CUDA device, got {device!r}")
        if dtype not in FLASH_ATTN_DTYPES:
            raise ValueError(f"the flash_attn backend computes in float16 or bfloat16, not "
                             f"{str(dtype).removeprefix('torch.')}; use --attention-backend triton")
        if not _flash_attn_imports():
            raise ValueError("the flash_attn backend was asked for but `import flash_attn` "
                             "fails; install flash-attn or use --attention-backend triton")
        from nanoserve.runner.attention.flash_attn_backend import FlashAttnBackend
        return FlashAttnBackend(block_size)
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the triton backend needs a CUDA device, got {device!r}; on the CPU "
                         f"use the torch backend (or set TRITON_INTERPRET=1 to run the kernels "
                         f"in Triton's interpreter, slowly)")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"the triton backend needs a power-of-two block size >= 16, "
                         f"got {block_size}")
    from nanoserve.runner.attention.triton_kernels import TritonBackend
    return TritonBackend()
