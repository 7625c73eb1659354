"""What the paged kernels share, inlined by Triton: a K/V tile through the block table and one
online-softmax step over it (decode and prefill); a decode program's row, its split's keys and
the writing of its result (both decode kernels)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, table, offs_n, mask_n, kv_head, offs_d,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 BLOCK_SIZE: tl.constexpr):
    """K and V of key positions offs_n ([BLOCK_N, HEAD_DIM] each); masked keys read as 0."""
    block = tl.load(table + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    tok = offs_n % BLOCK_SIZE
    k = tl.load(k_cache_ptr + block[:, None] * stride_kb + tok[:, None] * stride_kt
                + kv_head * stride_kh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    v = tl.load(v_cache_ptr + block[:, None] * stride_vb + tok[:, None] * stride_vt
                + kv_head * stride_vh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    return k, v


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
def query_row(query_start_ptr, seq, PACKED_Q: tl.constexpr):
    """The q and output row of sequence `seq`: `seq` itself, or in a mixed step's packed rows its
    query start, and -1 where the sequence has more than one query (a prompt's chunk)."""
    if PACKED_Q:
        first = tl.load(query_start_ptr + seq)
        return tl.where(tl.load(query_start_ptr + seq + 1) - first == 1, first, -1)
    return seq


@triton.jit
def split_share(seq_len, num_splits, split_tiles, BLOCK_N: tl.constexpr):
    """(the sequence's tiles of BLOCK_N keys, tiles per split): split_tiles where given, else the
    tiles divided evenly over num_splits; at least 1."""
    tiles = tl.cdiv(seq_len, BLOCK_N)
    per = tl.where(split_tiles > 0, split_tiles, tl.cdiv(tiles, num_splits))
    return tiles, tl.maximum(per, 1)


@triton.jit
def split_range(seq_len, split, num_splits, split_tiles, BLOCK_N: tl.constexpr):
    """The keys [start, end) of split `split`: splits start on tile bounds, and the last one ends
    at seq_len, however long the context. Past the end, start >= seq_len (an empty range)."""
    _, per_split = split_share(seq_len, num_splits, split_tiles, BLOCK_N)
    start = split * per_split * BLOCK_N
    end = tl.where(split == num_splits - 1, seq_len, tl.minimum(start + per_split * BLOCK_N, seq_len))
    return start, end


@triton.jit
def decode_program(seq, split, seq_order_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr, num_splits,
                   split_tiles, stride_sl, stride_bt, BLOCK_N: tl.constexpr, ORDERED: tl.constexpr,
                   PACKED_Q: tl.constexpr, SPLIT: tl.constexpr):
    """What a decode program takes on, from its launch index `seq` and its split: (the sequence,
    its q row, its keys [start, end), its block table, idle). Idle: nothing to compute (a prompt's
    row of a mixed step, or a split past the end, padding rows included). Reads only what the host
    stages (order, query starts, lengths, tables), never what a kernel of the step writes, so it
    may run before waiting on the kernel ahead (PDL)."""
    if ORDERED:   # programs start in launch order: the longest sequences first leave no long tail
        seq = tl.load(seq_order_ptr + seq)
    q_row = query_row(query_start_ptr, seq, PACKED_Q)
    seq_len = tl.load(seq_lens_ptr + seq * stride_sl)
    start, end = split_range(seq_len, split, num_splits, split_tiles, BLOCK_N)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    idle = q_row < 0
    if SPLIT:   # the merge leaves a split past the end out
        idle = idle | (start >= seq_len)
    return seq, q_row, start, end, table, idle


@triton.jit
def write_decode_result(acc, m, l, q_row, part_rows, mask_h, split, num_splits, v_scale,
                        out_ptr, part_acc_ptr, part_lse_ptr, heads, offs_d, stride_ot, stride_oh,
                        HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, KV_FP8: tl.constexpr):
    """A decode program's (acc, m, l) for q heads `heads`: the output row itself, or with several
    splits the normalized partial and its log-sum-exp at workspace rows part_rows (sequence x q
    heads + head) for the merge. A split with no keys leaves zeros and -inf."""
    has_keys = l > 0
    l = tl.where(has_keys, l, 1.0)
    o = acc / l[:, None]   # no keys: acc is 0, so o is 0
    if KV_FP8:
        o = o * v_scale   # the merge of splits is linear in o: scaling each partial suffices
    if SPLIT:
        row = part_rows * num_splits + split
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask_h[:, None])
        tl.store(part_lse_ptr + row, tl.where(has_keys, m + tl.log2(l), float("-inf")), mask=mask_h)
    else:
        tl.store(out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None])
