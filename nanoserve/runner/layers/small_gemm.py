"""y = x W^T (+ bias) for a few rows of x, in Triton: the decode-time linear layers.

With 1-32 rows a linear layer is a pass over its weight; the rows of x are nearly free. Each
program streams one [BLOCK_N, K-range] slab of the weight once and multiplies every row of x by
it, accumulating in float32. One or two rows use CUDA cores (multiply, sum over K at the end);
more use tl.dot with the weight as the left operand and the rows padded to 16: the padding costs
tensor-core cycles only, which a pass over memory leaves idle. Past 64 rows the rows are tiled
too (64 a program), for the medium batches where cuBLAS leaves narrow layers (N = 1024) on a
fraction of the device.

When the output has too few column blocks to fill the device, the programs also split K. Each
split writes a float32 partial [split, rows, N], and split_k_sum.py sums them in split order:
the tile's last split to finish, or a second kernel.

Gated input (the `down` projection of a gated MLP): x holds [gate | up] and the kernel computes
silu(gate) * up as it loads, rounded to x's dtype as the separate SiLU-mul kernel stores it, so
that kernel and its launch drop out of the step.

Normed input (1-2 rows: the projections that follow a layer's RMSNorm): the kernel takes the
norm's input and residual, adds them, and normalizes as it loads, rounding where the eager add +
RMSNorm (ops.py) rounds, with the norm kernel's own steps (rms_norm_kernel.py); each program first
reads the whole rows for their mean square (a few KB, from L2), and the first program also writes
the new residual. The norm's launch drops out. The mean square sums in another order than the
norm kernel's, so the product can differ from its path by a rounding; the new residual is the
same bits.

CUDA-graph safe: no host syncs; the config depends on (rows, N, K) and the device only, and the
partials come from torch's allocator (the graph pool during capture).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanoserve.runner.layers import split_k_sum
from nanoserve.runner.layers.linear import row_bucket
from nanoserve.runner.layers.rms_norm_kernel import load_sum, normed, rms_scale
from nanoserve.runner.layers.split_k_sum import sum_if_last, sum_splits
from nanoserve.runner.pdl import pdl_launch, pdl_prologue

MAX_ROWS = 512
ROW_TILE = 64        # rows per program past 64 rows
WAVES = 2            # programs per SM to aim for before shrinking tiles or splitting K stops
MAX_SPLITS = 16
FMA_TILE = 8192      # weight elements x rows per loop step in the CUDA-core path (registers)
SMEM_BUDGET = 96 * 1024   # bytes of pipelined tiles a tl.dot program may hold in shared memory
PRELOAD_FIRST_TILE = True  # 1-2 rows: load the first weight tile before waiting on the kernel ahead (PDL)


@dataclass(frozen=True)
class SkinnyConfig:
    block_m: int     # rows of x per program: 1 or 2 on CUDA cores, >= 16 for tl.dot
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _load_x(ptrs, mask, K, GATED: tl.constexpr):
    """A tile of x; for a gated input silu(gate) * up, with up K columns right of gate."""
    if GATED:
        gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        return (gate * tl.sigmoid(gate) * up).to(ptrs.dtype.element_ty)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _inv_rms(x_row, res_row, new_res_row, K, eps, store, HAS_RES: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(h^2) + eps) of one row h = x (+ residual); `store`: also write h there."""
    offs_k = tl.arange(0, BLOCK_K)
    squares = tl.zeros([BLOCK_K], tl.float32)
    stored = tl.where(store, K, 0)   # the columns this program writes: all of them, or none
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        h = load_sum(x_row + ks, res_row + ks, ks < K, HAS_RES)
        squares += h * h
        if HAS_RES:
            tl.store(new_res_row + ks, h.to(new_res_row.dtype.element_ty), mask=ks < stored)
    return rms_scale(tl.sum(squares, 0), K, eps)


@triton.jit
def _load_normed(x_ptrs, res_ptrs, gamma_ptrs, mask, inv_rms, HAS_RES: tl.constexpr):
    """gamma * (h * inv_rms) in x's dtype, rounded as the norm kernel rounds (rms_norm_kernel.normed)."""
    gamma = tl.load(gamma_ptrs, mask=mask, other=0.0).to(tl.float32)
    return normed(load_sum(x_ptrs, res_ptrs, mask, HAS_RES), inv_rms, gamma, x_ptrs.dtype.element_ty)


@triton.jit
def _load_w(w_rows, ks, k_end, MASKED: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] tile of the weight; masked past k_end where asked."""
    if MASKED:
        return tl.load(w_rows + ks[None, :], mask=ks[None, :] < k_end, other=0.0)
    else:
        return tl.load(w_rows + ks[None, :])


@triton.jit
def _fma_tile(w, ks, k_end, x_ptr, x_stride, row1, K, acc0, acc1, BLOCK_M: tl.constexpr,
              MASKED: tl.constexpr, GATED: tl.constexpr, res_ptr, gamma_ptr, inv_rms0, inv_rms1,
              NORMED: tl.constexpr, HAS_RES: tl.constexpr):
    """acc{0,1} += w * x{0,1} over the columns ks: the rows of x loaded (and normed or gated) here."""
    mask = ks < k_end
    if NORMED:
        x0 = _load_normed(x_ptr + ks, res_ptr + ks, gamma_ptr + ks, mask, inv_rms0, HAS_RES)
    elif MASKED:
        x0 = _load_x(x_ptr + ks, mask, K, GATED)
    else:
        x0 = tl.load(x_ptr + ks)
    w = w.to(tl.float32)
    acc0 += w * x0.to(tl.float32)[None, :]
    if BLOCK_M == 2:
        if NORMED:
            x1 = _load_normed(x_ptr + row1 * x_stride + ks, res_ptr + row1 * K + ks, gamma_ptr + ks,
                              mask, inv_rms1, HAS_RES)
        else:
            x1 = _load_x(x_ptr + row1 * x_stride + ks, mask, K, GATED)
        acc1 += w * x1.to(tl.float32)[None, :]
    return acc0, acc1


@triton.jit
def _fma_steps(x_ptr, x_stride, w_rows, w_first, M, K, k_start, k_end, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               GATED: tl.constexpr, res_ptr, gamma_ptr, inv_rms0, inv_rms1,
               NORMED: tl.constexpr, HAS_RES: tl.constexpr):
    """One or two rows on CUDA cores: products add up elementwise in [BLOCK_N, BLOCK_K] and are
    summed over K once at the end, so the loop is loads and FMAs only. Plain 2D tiles with x
    broadcast along N keep the weight load coalesced (a 3D rows x N x K product would not).
    w_first is the split's first weight tile, loaded by the caller (masked: a split may be empty)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)   # the second row; dead code for one row
    row1 = tl.minimum(M - 1, 1)   # a lone row reads itself again as row 1; those sums are never stored
    acc0, acc1 = _fma_tile(w_first, k_start + offs_k, k_end, x_ptr, x_stride, row1, K, acc0, acc1,
                           BLOCK_M, True, GATED, res_ptr, gamma_ptr, inv_rms0, inv_rms1, NORMED, HAS_RES)
    masked: tl.constexpr = NORMED or GATED or not EVEN_K
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        ks = k0 + offs_k
        w = _load_w(w_rows, ks, k_end, masked)
        acc0, acc1 = _fma_tile(w, ks, k_end, x_ptr, x_stride, row1, K, acc0, acc1, BLOCK_M, masked,
                               GATED, res_ptr, gamma_ptr, inv_rms0, inv_rms1, NORMED, HAS_RES)
    rows = tl.arange(0, BLOCK_M)[:, None]
    return tl.where(rows == 0, tl.sum(acc0, 1)[None, :], tl.sum(acc1, 1)[None, :])


@triton.jit
def _dot_steps(x_ptr, x_stride, w_rows, M, K, k_start, k_end, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               PRECISION: tl.constexpr, GATED: tl.constexpr):
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    x_rows = x_ptr + offs_m[:, None] * x_stride
    mask_m = offs_m[:, None] < M
    # W x^T: the weight is the tall operand, x^T the narrow one
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + offs_k
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :])
            x = _load_x(x_rows + ks[None, :], mask_m, K, GATED)
        else:
            w = tl.load(w_rows + ks[None, :], mask=ks[None, :] < k_end, other=0.0)
            x = _load_x(x_rows + ks[None, :], mask_m & (ks[None, :] < k_end), K, GATED)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    return tl.trans(acc)


# M changes with the batch: unspecialized, one compile serves every row count of a bucket
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, sum_ptr, counts_ptr, M, N, K, x_stride, k_per_split,
    res_ptr, gamma_ptr, new_res_ptr, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, GATED: tl.constexpr,
    NORMED: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr, PRELOAD: tl.constexpr,
    SPLIT_K: tl.constexpr = 1, SUM_IN_LAST: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row0 = tl.program_id(2) * BLOCK_M   # this program's first row
    split_stride = M * N                # out_ptr holds a [split, M, N] partial a split (SPLIT), else the output
    first_part = out_ptr + row0 * N     # split 0's partial of this program's rows
    x_ptr += row0 * x_stride
    out_ptr = first_part + split * split_stride
    M -= row0                           # rows from row0 on
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # rows past N re-read row N-1 so weight loads need no N mask; their sums are never stored
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * K
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if BLOCK_M < 16 and PRELOAD:
        # weights are written by no kernel of the step: the first tile's load may start while the
        # kernel ahead still runs, and a program of two or three tiles hides most of its latency
        w_first = _load_w(w_rows, k_start + tl.arange(0, BLOCK_K), k_end, True)
    pdl_prologue(USE_PDL)   # x is read only past this point: the kernel ahead may write it
    if BLOCK_M < 16 and not PRELOAD:
        w_first = _load_w(w_rows, k_start + tl.arange(0, BLOCK_K), k_end, True)
    if BLOCK_M >= 16:
        acc = _dot_steps(x_ptr, x_stride, w_rows, M, K, k_start, k_end, BLOCK_M, BLOCK_N, BLOCK_K,
                         EVEN_K, PRECISION, GATED)
    else:
        inv_rms0 = 1.0
        inv_rms1 = 1.0
        if NORMED:   # 1-2 rows, row0 0; the first program writes the new residual
            store = (pid_n == 0) & (split == 0)
            inv_rms0 = _inv_rms(x_ptr, res_ptr, new_res_ptr, K, eps, store, HAS_RES, BLOCK_K)
            if BLOCK_M == 2:
                row1 = tl.minimum(M - 1, 1)
                inv_rms1 = _inv_rms(x_ptr + row1 * x_stride, res_ptr + row1 * K, new_res_ptr + row1 * K, K, eps,
                                    store & (M > 1), HAS_RES, BLOCK_K)
        acc = _fma_steps(x_ptr, x_stride, w_rows, w_first, M, K, k_start, k_end, BLOCK_M, BLOCK_N, BLOCK_K,
                         EVEN_K, GATED, res_ptr, gamma_ptr, inv_rms0, inv_rms1, NORMED, HAS_RES)
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
        if SUM_IN_LAST:
            sum_if_last(first_part, split_stride, sum_ptr + row0 * N, bias_ptr, counts_ptr,
                         tl.program_id(2) * tl.num_programs(0) + pid_n, offs_m, offs_n, mask, N,
                         SPLIT_K, HAS_BIAS, BLOCK_M, BLOCK_N)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4   # the interpreter: small enough that test shapes exercise split-K
    return torch.cuda.get_device_properties(device).multi_processor_count


def skinny_config(rows: int, n: int, k: int, sms: int, elem_bytes: int = 2) -> SkinnyConfig:
    """Tiles for `rows` x [n, k]: the widest column block that still gives WAVES programs per SM,
    else the narrowest, with K split until the programs fill the device. Past ROW_TILE rows the
    rows are tiled as well."""
    bucket = row_bucket(rows)
    target = WAVES * sms
    k_pow2 = max(16, triton.next_power_of_2(k))
    if bucket <= 2:
        # CUDA cores: a tile of FMA_TILE products, its rows long enough for coalesced loads
        widths = [w for w in (16, 8, 4) if FMA_TILE // (w * bucket) >= 256] or [4]
        block_n = next((w for w in widths if triton.cdiv(n, w) >= target), widths[-1])
        block_m, block_k = bucket, min(k_pow2, FMA_TILE // (block_n * bucket))
        warps, stages = 8, 2   # 8 warps: the float32 sums of a tile take 32 registers a thread
    else:
        if bucket <= ROW_TILE:
            block_m, block_k = max(16, bucket), min(256, k_pow2)
            block_n = next((w for w in (64, 32, 16) if triton.cdiv(n, w) >= target), 16)
            warps = 4
        else:
            # a tiled GEMM: ROW_TILE rows a program, the widest column block that still fills
            # the device together with the row tiles, K split below
            block_m, block_k = ROW_TILE, min(64, k_pow2)
            row_tiles = triton.cdiv(bucket, ROW_TILE)
            block_n = next((w for w in (128, 64) if triton.cdiv(n, w) * row_tiles >= target), 32)
            warps = 8 if block_n == 128 else 4
        # as many stages in flight as fit SMEM_BUDGET (leaves room for two programs an SM)
        stage_bytes = (block_n + block_m) * block_k * elem_bytes
        stages = max(2, min(4, SMEM_BUDGET // stage_bytes))
    while k % block_k and block_k > 256:
        block_k //= 2   # whole blocks if a shorter one divides K: no masked half-empty last step
    tiles = triton.cdiv(n, block_n) * triton.cdiv(bucket, block_m)
    split = 1
    while (tiles * split * 2 <= target and split * 2 <= MAX_SPLITS
           and split * 2 <= triton.cdiv(k, block_k)):
        split *= 2
    return SkinnyConfig(block_m, block_n, block_k, split, warps, stages)


def skinny_linear_normed(x: torch.Tensor, residual: torch.Tensor | None, gamma: torch.Tensor, eps: float,
                         weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: SkinnyConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight^T (+ bias), x + residual) for 1-2 rows, as the add +
    RMSNorm kernel and skinny_linear give them apart; without a residual, rms_norm(x) and x."""
    if x.shape[0] > 2 or not x.is_contiguous() or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"skinny_linear_normed takes 1-2 contiguous rows and a residual of their shape, "
                         f"got x {tuple(x.shape)}, residual {None if residual is None else tuple(residual.shape)}")
    new_residual = torch.empty_like(x) if residual is not None else x
    norm = (residual.contiguous() if residual is not None else None, gamma, new_residual, eps)
    return skinny_linear(x, weight, bias, config, norm=norm), new_residual


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None, gated: bool = False,
                  norm: tuple | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) in x's dtype, float32 sums; M <= MAX_ROWS.

    gated: x is [M, 2K], gate then up, and the product is silu(gate) * up @ weight^T.
    norm: (residual or None, gamma, new residual, eps) from skinny_linear_normed.
    `config` overrides the tile heuristic (tests, benchmarks)."""
    m, width = x.shape
    k = width // 2 if gated else width
    n = weight.shape[0]
    if (weight.shape[1] != k or (gated and width != 2 * k) or not weight.is_contiguous()
            or weight.dtype != x.dtype):
        raise ValueError(f"skinny_linear needs a contiguous weight [N, {k}] of x's dtype "
                         f"{x.dtype} for x of width {width}{' (gated)' if gated else ''}, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {m}; use F.linear")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x = x.contiguous()
    cfg = config or skinny_config(m, n, k, num_sms(x.device), x.element_size())
    if cfg.block_m < 16 and (cfg.block_m > 2 or cfg.block_m < m):
        raise ValueError(f"{cfg} cannot take {m} rows: block_m is 1 or 2 (and >= rows), or >= 16")
    if norm is not None and (cfg.block_m > 2 or gated):
        raise ValueError(f"a normed input needs the 1-2 row tiles and no gate, got {cfg}")
    # every split but the last starts on a block boundary
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = cfg.split_k > 1
    part = split_k_sum.split_partials(cfg.split_k, m, n, x.device) if split else out
    has_bias = bias is not None
    res, gamma, new_res, eps = norm or (None, weight, x, 0.0)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k, triton.cdiv(m, cfg.block_m))
    counts = split_k_sum.tile_counts(x.device, cfg.block_m, grid[0] * grid[2]) if split else None
    _skinny_kernel[grid](
        x, weight, bias if has_bias else weight, part, out, out if counts is None else counts,
        m, n, k, width, k_per_split,
        x if res is None else res, gamma, new_res, eps,   # x stands in for pointers that go unread
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, SPLIT=split, HAS_BIAS=has_bias, GATED=gated,
        NORMED=norm is not None, HAS_RES=res is not None,
        # float32 inputs keep full precision (tf32 would cost ~1e-3 relative error)
        PRECISION="ieee" if x.dtype == torch.float32 else None,
        PRELOAD=PRELOAD_FIRST_TILE, SPLIT_K=cfg.split_k, SUM_IN_LAST=counts is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device),
    )
    if split and counts is None:
        sum_splits(part, bias, out)
    return out
