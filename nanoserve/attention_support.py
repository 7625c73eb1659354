"""What each attention backend can run: one rule set for the config, which refuses a combination
before any weight loads, and for the runner's backend choice, which callers may reach directly.

No torch import: dtypes are compared by name, so the CLI's checks stay fast.
"""

from __future__ import annotations

import os

from nanoserve.defaults import FP8_FLASH_ATTN_REFUSAL

HALF_DTYPES = ("float16", "bfloat16")   # what flash-attn computes in


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def attention_refusal(name: str, device: str, block_size: int, kv_cache_dtype: str, dtype: object) -> str | None:
    """Why backend `name` (resolved: torch, triton or flash_attn) cannot serve this combination,
    or None when it can."""
    on_cuda = device.startswith("cuda")
    if name == "flash_attn":
        if kv_cache_dtype == "fp8":
            return FP8_FLASH_ATTN_REFUSAL
        if not on_cuda:
            return (f"attention_backend='flash_attn' needs a CUDA device, got {device!r}; use "
                    "--attention-backend torch (or auto) on the CPU")
        if _dtype_name(dtype) not in HALF_DTYPES:
            return (f"attention_backend='flash_attn' computes in float16 or bfloat16, not {_dtype_name(dtype)}; "
                    "use --attention-backend triton")
    if name == "triton":
        if block_size < 16 or block_size & (block_size - 1):
            return (f"the triton attention backend needs a power-of-two block_size >= 16, got {block_size}; "
                    "use --block-size 16 or more")
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            return (f"attention_backend='triton' needs a CUDA device, got {device!r}; use --attention-backend "
                    "torch (or auto) on the CPU, or set TRITON_INTERPRET=1 to run the kernels in Triton's "
                    "interpreter, slowly")
        if not on_cuda and _dtype_name(dtype) == "bfloat16":
            # the interpreter's tl.dot returns garbage in bfloat16 (Triton 3.9): the server answered nonsense
            return ("attention_backend='triton' on the CPU runs in Triton's interpreter, which computes "
                    "bfloat16 wrongly; use --dtype float32 or float16, or --attention-backend torch")
    return None
