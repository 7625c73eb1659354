"""One pass over the logits: temperature, Gumbel noise and argmax fused in a Triton kernel.

argmax(logits / T + G) with G = -log(-log(U)) is a draw from softmax(logits / T) (the Gumbel-max
trick), so a row needs no softmax, no float32 copy of the logits and no second pass. Each row's
noise comes from its own Philox seed, so a seeded row draws the same token whatever else is in
the batch. Rows with temperature 0 take the plain argmax. A grammar's token bitmask (xgrammar's
layout: bit j of word i allows token 32 i + j) is read in the same pass, so constrained rows cost
no extra kernel and unconstrained rows in the batch read no mask at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.random import uint_to_uniform_float

from nanoserve.runner.pdl import pdl_launch, pdl_prologue

BLOCK = 1024
CHUNK = 4096  # vocabulary columns per program: rows x chunks programs keep every SM busy
MIN_TEMPERATURE = 1e-6  # 1 / temperature stays finite
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _consider(row_ptr, cols, vocab, bits, inv_temp, best, best_idx, words_ptr, masked_cols,
              NOISE: tl.constexpr, FAST_LOG: tl.constexpr):
    """Fold one tile of columns into each lane's running best score and its index; with NOISE the
    score is x / T plus the Gumbel noise drawn from `bits`, else x itself (a greedy row)."""
    mask = cols < vocab
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
    score = x
    if NOISE:
        # u in [0, 1): u = 0 gives -inf noise, a token that can never win, which is harmless
        u = uint_to_uniform_float(bits)
        if FAST_LOG:   # one MUFU instruction per log instead of a polynomial: the kernel is bound by issue
            noise = -LN2 * libdevice.fast_log2f(-LN2 * libdevice.fast_log2f(u))
        else:
            noise = -tl.log(-tl.log(u))
        score = x * inv_temp + noise
    if words_ptr is not None:
        word = tl.load(words_ptr + (cols >> 5), mask=cols < masked_cols, other=-1)  # -1: all allowed
        mask = mask & (((word >> (cols & 31)) & 1) != 0)
    score = tl.where(mask, score, float("-inf"))
    better = score > best  # strict: a lane sees its columns in increasing order and keeps the first
    return tl.where(better, score, best), tl.where(better, cols, best_idx)


@triton.jit
def _scan(row_ptr, first, last, vocab, seed, inv_temp, words_ptr, masked_cols, QUARTER: tl.constexpr,
          NOISE: tl.constexpr, FAST_LOG: tl.constexpr):
    """Each lane's best score and its index over columns first..last, BLOCK = 4 QUARTER at a time."""
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_idx = tl.zeros([QUARTER], tl.int32)
    lanes = tl.arange(0, QUARTER)
    for start in range(first, last, 4 * QUARTER):
        # one Philox call makes four draws, one for each quarter of the tile; the noise depends on
        # (seed, column) alone, so it does not matter how the row is split into chunks
        r0, r1, r2, r3 = tl.randint4x(seed, start // 4 + lanes) if NOISE else (lanes, lanes, lanes, lanes)
        best, best_idx = _consider(row_ptr, start + lanes, vocab, r0, inv_temp, best, best_idx,
                                   words_ptr, masked_cols, NOISE, FAST_LOG)
        best, best_idx = _consider(row_ptr, start + QUARTER + lanes, vocab, r1, inv_temp, best, best_idx,
                                   words_ptr, masked_cols, NOISE, FAST_LOG)
        best, best_idx = _consider(row_ptr, start + 2 * QUARTER + lanes, vocab, r2, inv_temp, best, best_idx,
                                   words_ptr, masked_cols, NOISE, FAST_LOG)
        best, best_idx = _consider(row_ptr, start + 3 * QUARTER + lanes, vocab, r3, inv_temp, best, best_idx,
                                   words_ptr, masked_cols, NOISE, FAST_LOG)
    return best, best_idx


@triton.jit
def _chunk_kernel(logits_ptr, stride, inv_temp_ptr, seeds_ptr, best_ptr, best_idx_ptr, vocab, num_chunks,
                  bitmask_ptr, mask_row_ptr, mask_stride, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                  FAST_LOG: tl.constexpr, USE_PDL: tl.constexpr):
    """The best score and its first index within one chunk of one row."""
    pdl_prologue(USE_PDL)
    QUARTER: tl.constexpr = BLOCK // 4
    row, chunk = tl.program_id(0), tl.program_id(1)
    row_ptr = logits_ptr + row * stride
    inv_temp = tl.load(inv_temp_ptr + row)
    seed = tl.load(seeds_ptr + row)
    words_ptr = bitmask_ptr
    masked_cols = 0  # the columns that read the row's bitmask: all of them, or none without a grammar
    if bitmask_ptr is not None:
        mask_row = tl.load(mask_row_ptr + row)  # -1: this row has no grammar
        masked_cols = tl.where(mask_row >= 0, vocab, 0)
        words_ptr = bitmask_ptr + tl.maximum(mask_row, 0).to(tl.int64) * mask_stride
    first, last = chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, vocab)
    if inv_temp == 0.0:   # a greedy row (the whole program's): no noise to draw
        best, best_idx = _scan(row_ptr, first, last, vocab, seed, inv_temp, words_ptr, masked_cols, QUARTER,
                               False, FAST_LOG)
    else:
        best, best_idx = _scan(row_ptr, first, last, vocab, seed, inv_temp, words_ptr, masked_cols, QUARTER,
                               True, FAST_LOG)
    top = tl.max(best, axis=0)
    # the first index among lanes holding the maximum, as torch.argmax returns
    tl.store(best_ptr + row * num_chunks + chunk, top)
    tl.store(best_idx_ptr + row * num_chunks + chunk, tl.min(tl.where(best == top, best_idx, vocab), axis=0))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  bitmask: torch.Tensor | None = None, mask_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Sampled token per row of logits [rows, vocab]; temperature [rows] (0 = greedy), seeds [rows] int.

    With a grammar: `bitmask` [masks, words] int32 of allowed tokens, and `mask_rows` [rows] int32,
    each row's bitmask row or -1 for a row that draws from the whole vocabulary."""
    return gumbel_argmax_scaled(logits, inverse_temperature(temperature), seeds, bitmask, mask_rows)


def inverse_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """1 / temperature in float32, 0 where the temperature is 0 (a greedy row)."""
    temperature = temperature.float()
    return torch.where(temperature > 0, 1.0 / temperature.clamp(min=MIN_TEMPERATURE),
                       torch.zeros_like(temperature))


def gumbel_argmax_scaled(logits: torch.Tensor, inv_temp: torch.Tensor, seeds: torch.Tensor,
                         bitmask: torch.Tensor | None = None, mask_rows: torch.Tensor | None = None) -> torch.Tensor:
    """gumbel_argmax with each row's 1 / temperature given (float32, 0 = greedy): a decode graph
    stages that on the host, so the draw inside the graph is this one kernel and its reduction."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    num_chunks = triton.cdiv(vocab, CHUNK)
    best = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    _chunk_kernel[(rows, num_chunks)](logits, logits.stride(0), inv_temp, seeds, best, best_idx, vocab,
                                      num_chunks, bitmask, mask_rows, bitmask.shape[1] if bitmask is not None else 0,
                                      CHUNK=CHUNK, BLOCK=BLOCK, FAST_LOG=logits.is_cuda, **pdl_launch(logits.device))
    # across chunks: torch.argmax takes the first maximum, so ties go to the lowest column
    return best_idx.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1).long()


def warm_up(vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compile every variant a step can ask for (model-dtype or float32 logits, with or without a
    grammar's mask) now, not on the first request that needs one: a compile there stalls the
    whole batch for a fraction of a second."""
    temperature = torch.ones(2, device=device)
    seeds = torch.zeros(2, dtype=torch.int64, device=device)
    bitmask = torch.full((1, triton.cdiv(vocab, 32)), -1, dtype=torch.int32, device=device)
    mask_rows = torch.tensor([0, -1], dtype=torch.int32, device=device)
    for logits_dtype in {dtype, torch.float32}:
        logits = torch.zeros(2, vocab, dtype=logits_dtype, device=device)
        gumbel_argmax(logits, temperature, seeds)
        gumbel_argmax(logits, temperature, seeds, bitmask, mask_rows)
