"""Attention backends behind one interface:
forward(q, k, v, k_cache, v_cache, meta, scale, k_scale=1.0, v_scale=1.0, window=None), the scales
applying only to an fp8 cache (attention/fp8.py), and window, a layer's sliding window, keeping the
keys k of a query at position p with p - window < k <= p (transformers' convention; None: all).
A backend with `fuses_kv_store` also offers attend_qkv (from the packed q/k/v projection: q/k norm,
rotary, the K/V store and attention) and attend (forward without the store), which take the window too.

torch (reference, CPU), triton (our kernels, CUDA or the Triton interpreter), flash_attn (when
the package imports). Kernel modules import lazily: importing this package loads no Triton.
"""

from __future__ import annotations

import importlib.util

import torch

from nanoserve.attention_support import attention_refusal
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
    if name == "auto":
        if (on_cuda and block_size % 256 == 0 and attention_refusal("flash_attn", device, block_size,
                                                                    kv_cache_dtype, dtype) is None
                and _flash_attn_imports()):
            name = "flash_attn"
        else:
            name = "triton" if on_cuda else "torch"
    why = attention_refusal(name, device, block_size, kv_cache_dtype, dtype)
    if why:
        raise ValueError(why)
    if name == "torch":
        return TorchBackend()
    if name == "flash_attn":
        if not _flash_attn_imports():
            raise ValueError("the flash_attn backend was asked for but `import flash_attn` "
                             "fails; install flash-attn or use --attention-backend triton")
        from nanoserve.runner.attention.flash_attn_backend import FlashAttnBackend
        return FlashAttnBackend(block_size)
    from nanoserve.runner.attention.triton_kernels import TritonBackend
    return TritonBackend()
