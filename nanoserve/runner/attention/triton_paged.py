"""What paged decode and prefill share: a K/V tile through the block table, one online-softmax
step over it (inlined into both kernels by Triton), and the checks and scales of their launches."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nanoserve.runner.attention.fp8 import is_fp8
from nanoserve.runner.attention.kv_layout import tokens_contiguous
from nanoserve.runner.attention.triton_fp8 import to_fp8


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, table, offs_n, mask_n, kv_head, offs_d,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                 BLOCK_SIZE: tl.constexpr):
    """K and V of key positions offs_n ([BLOCK_N, HEAD_DIM] each); masked keys read as 0."""
    block = tl.load(table + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    return load_kv_rows(k_cache_ptr, v_cache_ptr, block, offs_n % BLOCK_SIZE, mask_n, kv_head, offs_d,
                        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd)


@triton.jit
def load_kv_rows(k_cache_ptr, v_cache_ptr, block, tok, mask_n, kv_head, offs_d,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd):
    """K and V of tokens `tok` of physical block(s) `block` (one per token, or one for the whole
    tile), [BLOCK_N, HEAD_DIM] each; masked keys read as 0. V may lie in any layout (stride_vd)."""
    k_rows = block * stride_kb + tok * stride_kt + kv_head * stride_kh
    v_rows = block * stride_vb + tok * stride_vt + kv_head * stride_vh
    k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=mask_n[:, None], other=0.0)
    return k, v


@triton.jit
def load_kv_block_tile(k_cache_ptr, v_cache_ptr, block, first, mask_n, kv_head, offs_d,
                       stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                       BLOCK_N: tl.constexpr, V_TOKENS_CONTIGUOUS: tl.constexpr):
    """K and V of the BLOCK_N tokens from `first` (a multiple of BLOCK_N) of one physical block,
    [BLOCK_N, HEAD_DIM] each; masked keys of K read as 0. V with its tokens contiguous
    (attention/kv_layout.py) is read whole, masked keys included, in 16-byte rows along the
    tokens, and comes out as any other V tile."""
    tok = tl.multiple_of(first, BLOCK_N) + tl.arange(0, BLOCK_N)
    if not V_TOKENS_CONTIGUOUS:
        return load_kv_rows(k_cache_ptr, v_cache_ptr, block, tok, mask_n, kv_head, offs_d,
                            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd)
    k_rows = block * stride_kb + tok * stride_kt + kv_head * stride_kh
    k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    v_rows = block * stride_vb + kv_head * stride_vh + offs_d[:, None] * stride_vd
    # the pipeliner carries `first` into the loop, where its divisibility is no longer known:
    # restated here, or the tile is read one byte at a time
    v_offs = tl.max_contiguous(tl.multiple_of(v_rows + tok[None, :], [1, BLOCK_N]), [1, BLOCK_N])
    v_t = tl.load(v_cache_ptr + v_offs)
    return k, tl.trans(v_t)


@triton.jit
def slot_offset(slot, BLOCK_SIZE: tl.constexpr, stride_b, stride_t):
    """Where cache slot `slot` (block * BLOCK_SIZE + offset) starts in a cache of any layout."""
    return (slot // BLOCK_SIZE) * stride_b + (slot % BLOCK_SIZE) * stride_t


@triton.jit
def store_kv_rows(k, v, slot, heads, mask_h, offs_d, k_cache_ptr, v_cache_ptr, inv_k_scale, inv_v_scale,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd,
                  BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr, STORE_V: tl.constexpr):
    """One token's k and v ([heads, HEAD_DIM], rows mask_h) into cache slot `slot`, as the cache
    holds them: rounded once to its dtype, or for an fp8 cache k / k_scale and v / v_scale in e4m3.
    STORE_V False: k only (the decode kernel stores v: store_v_sectors)."""
    if KV_FP8:
        k = to_fp8(k, inv_k_scale, k_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + slot_offset(slot, BLOCK_SIZE, stride_kb, stride_ks) + heads[:, None] * stride_kh
             + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask_h[:, None])
    if STORE_V:
        if KV_FP8:
            v = to_fp8(v, inv_v_scale, v_cache_ptr.dtype.element_ty)
        tl.store(v_cache_ptr + slot_offset(slot, BLOCK_SIZE, stride_vb, stride_vs) + heads[:, None] * stride_vh
                 + offs_d[None, :] * stride_vd, v.to(v_cache_ptr.dtype.element_ty), mask=mask_h[:, None])


@triton.jit
def store_v_sectors(v_row, v_cache_ptr, block, pos, kv_head, offs_d, inv_v_scale, stride_vb, stride_vh, stride_vd,
                    BLOCK_SIZE: tl.constexpr, SECTOR: tl.constexpr):
    """One token's v (a kv head's HEAD_DIM values at v_row) into an fp8 cache whose V lies along
    tokens (kv_layout.py), at position `pos` of physical block `block`, written as whole sectors.

    Stored alone, each of the token's HEAD_DIM bytes lands in a 32-byte sector of its own, and
    memory merges a partial sector by reading it first: on an H200 the store kernel took 14.6 us
    a layer for 256 tokens against 3.5 with V row by row (BENCHMARKS.md). Here each dim's sector
    around `pos` is read, the byte set in registers, and the sector written whole."""
    first = tl.multiple_of((pos % BLOCK_SIZE) // SECTOR * SECTOR, SECTOR)
    offs_s = tl.arange(0, SECTOR)
    offs = block * stride_vb + kv_head * stride_vh + offs_d[:, None] * stride_vd + first + offs_s[None, :]
    ptrs = v_cache_ptr + tl.max_contiguous(tl.multiple_of(offs, [1, SECTOR]), [1, SECTOR])
    # L2 only: the L1 keeps no copy of the old bytes for the attention loop to read back
    old = tl.load(ptrs, cache_modifier=".cg").to(tl.uint8, bitcast=True)
    v = to_fp8(tl.load(v_row + offs_d), inv_v_scale, v_cache_ptr.dtype.element_ty).to(tl.uint8, bitcast=True)
    merged = tl.where(offs_s[None, :] == pos % SECTOR, v[:, None], old)
    tl.store(ptrs, merged.to(v_cache_ptr.dtype.element_ty, bitcast=True))


@triton.jit
def online_softmax_step(qk, v, m, l, acc, PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores (masked ones -inf) and its values into (m, l, acc).
    Each row must see at least one unmasked key per tile, so m stays finite."""
    m_new = tl.maximum(m, tl.max(qk, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _prefetch_l2(ptrs):
    """Ask the L2 for the 128-byte lines at ptrs; nothing is read into registers, so nothing the
    program reads can be stale (the L2 is where every write lands)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_kv_tile(k_cache_ptr, v_cache_ptr, table, first, end, kv_head,
                     stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                     BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     LINES: tl.constexpr, V_TOKENS_CONTIGUOUS: tl.constexpr):
    """L2 prefetches of the K/V tile of keys [first, first + BLOCK_N) below `end`: LINES lines a
    key row (a row of HEAD_DIM elements), or with V's tokens contiguous one line a dim (a tile of
    BLOCK_N tokens lies in one block). Reads only the block table, which the host stages, so it
    may run before the PDL wait while the kernel ahead still writes the cache."""
    tok = first + tl.arange(0, BLOCK_N)
    valid = tok < end
    block = tl.load(table + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    cols = tl.arange(0, LINES) * (HEAD_DIM // LINES)
    k_rows = block * stride_kb + (tok % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
    _prefetch_l2(tl.where(valid[:, None], k_cache_ptr + k_rows[:, None] + cols[None, :], k_cache_ptr))
    if V_TOKENS_CONTIGUOUS:
        dims = tl.arange(0, HEAD_DIM)
        first_block = tl.load(table + first // BLOCK_SIZE, mask=first < end, other=0).to(tl.int64)
        v_dims = first_block * stride_vb + kv_head * stride_vh + dims * stride_vd + first % BLOCK_SIZE
        _prefetch_l2(tl.where(first < end, v_cache_ptr + v_dims, v_cache_ptr))
    else:
        v_rows = block * stride_vb + (tok % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
        _prefetch_l2(tl.where(valid[:, None], v_cache_ptr + v_rows[:, None] + cols[None, :] * stride_vd,
                              v_cache_ptr))


def softmax_scale_log2(scale: float, k_scale: float) -> float:
    """The kernels' exp2 scores: log2(e) folded in, and an fp8 cache's k_scale, so that stored
    keys enter the dot product as they are (k_scale 1.0 leaves the product bit for bit)."""
    return scale * k_scale * math.log2(math.e)


def dot_precision(dtype: torch.dtype) -> str | None:
    # float32 inputs keep full precision (tf32 would cost ~1e-3 relative error)
    return "ieee" if dtype == torch.float32 else None


def check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor) -> None:
    """Shared by decode and prefill: the layouts the kernels index without checking."""
    head_dim = q.shape[-1]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"Triton attention needs a power-of-two head dim >= 16, got {head_dim}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"Triton attention needs a power-of-two block size >= 16, "
                         f"got {block_size}")
    if q.shape[1] % kv_heads:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({kv_heads})")
    if k_cache.dtype != v_cache.dtype or (k_cache.dtype != q.dtype and not is_fp8(k_cache)):
        raise ValueError(f"caches of {k_cache.dtype} / {v_cache.dtype} for q of {q.dtype}: the "
                         f"cache holds q's dtype, or fp8 (e4m3) for --kv-cache-dtype fp8")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not "
                         f"match q {tuple(q.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if v_cache.stride(-1) != 1 and not (is_fp8(v_cache) and tokens_contiguous(v_cache)):
        raise ValueError("v_cache must be contiguous in its last dim, or (fp8) in its tokens: kv_layout.py")


def window_keys(window: int | None) -> int:
    """A sliding window as the kernels' WINDOW: its span in keys, 0 for none (the code of a model
    without one); checked, since the kernels take it as it is."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window spans at least one key, got {window}")
    return window or 0


def check_new_v(new_v: torch.Tensor, v_cache: torch.Tensor, batch: int, plain_decode: bool) -> None:
    """The layouts paged_decode's new_v store reads and writes without checking. plain_decode: the
    step is decode rows alone (no packed query rows) and without rope."""
    if not (is_fp8(v_cache) and tokens_contiguous(v_cache)):
        raise ValueError("new_v is stored by decode over an fp8 cache whose V lies along tokens only (kv_layout.py)")
    if not plain_decode:
        raise ValueError("new_v takes a decode-only step without rope (rope stores the new v itself)")
    if new_v.shape != (batch, v_cache.shape[2], v_cache.shape[3]) or new_v.stride(2) != 1:
        raise ValueError(f"new_v must be [{batch}, {v_cache.shape[2]}, {v_cache.shape[3]}], contiguous in its "
                         f"last dim, got {tuple(new_v.shape)} with strides {new_v.stride()}")
