"""Turns the last-position logits of each sampling row into a token, all rows at once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.runner.batch import SampleOutput, SequenceWork, TokenMask
from nanoserve.runner.penalties import PenaltyCounts, apply_penalties

# JSON has no -inf; OpenAI clients expect a large negative number instead
MIN_LOGPROB = -9999.0
# past this many candidates a row's filters are cheaper over its sorted vocabulary than its top-k
MAX_CANDIDATES = 1024


@dataclass
class SamplingTensors:
    """The per-row settings of one step, on the device. Flags let the common cases skip work."""

    temperature: torch.Tensor   # [rows] float32; 0 rows are greedy (stored as 1 to divide safely)
    greedy: torch.Tensor        # [rows] bool
    top_k: torch.Tensor | None  # [rows] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [rows] float32
    min_p: torch.Tensor | None  # [rows] float32
    all_greedy: bool
    seeds: list[tuple[int, int]]  # (row, per-step seed) of rows with a seed
    num_logprobs: int            # largest top-N asked for; -1 when no row wants logprobs
    top_logprobs: list[int | None]  # per row: how many top alternatives, None = no logprobs
    max_sampled_top_k: int       # the largest top_k among the rows that draw (0 when none does)

    @staticmethod
    def build(rows: list[SequenceWork], vocab_size: int, device: torch.device) -> "SamplingTensors":
        params = [w.params for w in rows]
        temps = [p.temperature for p in params]
        greedy = [t == 0.0 for t in temps]
        # a top_k past the vocabulary keeps all of it (and must not reach an int64 tensor as is)
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]

        def tensor(values: list, dtype: torch.dtype, needed: bool = True) -> torch.Tensor | None:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True) if needed else None

        seeds = [(i, step_seed(p.seed, w.start + w.num_new - w.num_prompt_tokens))
                 for i, (w, p) in enumerate(zip(rows, params)) if p.seed is not None and p.temperature > 0]
        sampled = [not g for g in greedy]
        return SamplingTensors(
            temperature=tensor([t if t > 0 else 1.0 for t in temps], torch.float32),
            greedy=tensor(greedy, torch.bool),
            top_k=tensor(top_k, torch.int64, any(k < vocab_size and s for k, s in zip(top_k, sampled))),
            top_p=tensor(top_p, torch.float32, any(p < 1.0 and s for p, s in zip(top_p, sampled))),
            min_p=tensor(min_p, torch.float32, any(p > 0.0 and s for p, s in zip(min_p, sampled))),
            all_greedy=all(greedy),
            seeds=seeds,
            num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
            top_logprobs=[p.logprobs for p in params],
            max_sampled_top_k=max((k for k, s in zip(top_k, sampled) if s), default=0),
        )


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    # splitmix64's finalizer: a bijection of 64-bit integers that scatters neighbouring inputs
    x = (x + 0x9E37_79B9_7F4A_7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded row at one output position. Every seed of the range
    (-2^63 .. 2^64 - 1, taken modulo 2^64) is mixed whole: Python's hash() folded seeds modulo
    2^61 - 1 and hashes -1 as -2, so seeds -1 and -2 drew the same tokens, as did 5 and 5 + 2^61 - 1,
    and an n = 2 request with seed -2 (its choices seeded -2 and -1) got one completion twice."""
    return _mix64(_mix64(seed & _MASK64) ^ position) & 0x7FFF_FFFF_FFFF


def seeded_noise(seed: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise for each token id of a seeded row, from the row's own generator.

    Every path draws a seeded row with this noise, indexed by token id: which path a step takes
    depends on the rest of the batch, and a seeded row must not notice."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.empty(vocab_size, dtype=torch.float32, device=device).exponential_(generator=gen)


def race(probs: torch.Tensor, ids: torch.Tensor | None, seeds: list[tuple[int, int]], vocab_size: int
         ) -> torch.Tensor:
    """argmax(p / E) with E ~ Exp(1) draws from p (the exponential race), with no sort. probs
    [rows, n] are over the token ids `ids` [rows, n] (None: the whole vocabulary in order);
    seeds: (row, seed) of the rows whose noise comes from their own generator."""
    noise = torch.empty_like(probs).exponential_()
    for row, seed in seeds:
        by_token = seeded_noise(seed, vocab_size, probs.device)
        noise[row] = by_token if ids is None else by_token[ids[row]]
    choice = (probs / noise).argmax(dim=-1)
    return choice if ids is None else ids.gather(1, choice[:, None]).squeeze(1)


def filtered_draw(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """One token per row, drawn after temperature, top-k, top-p over what top-k left (renormalized,
    as in vLLM and transformers) and min-p relative to the most likely token.

    The filters work on each row's candidates, best first: its k best when every drawing row has
    a top-k of at most MAX_CANDIDATES (Qwen3's generation config asks for 20: one top-k instead of
    a sort of the vocabulary), else the sorted vocabulary; min-p alone needs no order."""
    if st.top_k is None and st.top_p is None:
        values, ids = logits, None
    elif st.top_k is not None and st.max_sampled_top_k <= MAX_CANDIDATES:
        values, ids = logits.topk(st.max_sampled_top_k, dim=-1)
    else:
        values, ids = logits.sort(dim=-1, descending=True)
    x = values.float() / st.temperature[:, None]
    drop = torch.zeros_like(x, dtype=torch.bool)
    if st.top_k is not None:
        drop |= torch.arange(x.shape[1], device=x.device)[None, :] >= st.top_k[:, None]
    if st.top_p is not None:
        probs = x.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # drop a token once the mass before it already reaches top_p; the first always stays (a
        # top_p that rounds to 0 in float32 would otherwise leave a row of -inf)
        drop |= (probs.cumsum(dim=-1) - probs) >= st.top_p[:, None]
        drop[:, 0] = False
    if st.min_p is not None:
        drop |= (x - x.max(dim=-1, keepdim=True).values).exp() < st.min_p[:, None]
    return race(x.masked_fill(drop, float("-inf")).softmax(dim=-1), ids, st.seeds, logits.shape[1])


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """-inf, in place, wherever a constrained row's grammar forbids the token; other rows untouched."""
    import xgrammar as xgr  # only steps with a constrained row need it

    # xgrammar reads bitmask row i for logits row i: spread the compact rows over the batch (a few
    # bytes per row, all ones = allowed) rather than copy the constrained logits out and back.
    # Host tensors go up from pinned memory: a pageable upload would wait for the forward pass.
    pin = logits.is_cuda
    rows = torch.tensor(mask.rows, dtype=torch.int64, pin_memory=pin).to(logits.device, non_blocking=True)
    compact = mask.bitmask.to(logits.device, non_blocking=True)
    bitmask = torch.full((logits.shape[0], compact.shape[1]), -1, dtype=compact.dtype, device=logits.device)
    bitmask.index_copy_(0, rows, compact)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)


def sample(logits: torch.Tensor, rows: list[SequenceWork], token_mask: TokenMask | None = None) -> SampleOutput:
    """One token per row: argmax for temperature 0, else a draw from the filtered distribution."""
    tokens, logprobs = draw(logits, rows, token_mask)
    return SampleOutput(tokens.tolist(), logprobs if logprobs is not None else [None] * len(rows))


def draw(logits: torch.Tensor, rows: list[SequenceWork], token_mask: TokenMask | None = None,
         prev_tokens: torch.Tensor | None = None, penalty_counts: PenaltyCounts | None = None
         ) -> tuple[torch.Tensor, list | None]:
    """The sampled ids, left on the device, and the rows' logprobs (read now) when any row asks.

    Logprobs are those of the model, before penalties and the grammar's mask (as vLLM reports them).
    `penalty_counts` keeps penalized sequences' token counts from step to step."""
    st = SamplingTensors.build(rows, logits.shape[1], logits.device)
    adjusted = any(map(adjusts_logits, rows))
    if adjusted or st.num_logprobs >= 0:
        logits = logits.float()  # once, for both
    raw_logprobs = logits.log_softmax(dim=-1) if st.num_logprobs >= 0 else None
    if adjusted:
        # a grammar's rows carry their allowed ids in its bitmask (the engine folds them in)
        apply_penalties(logits, rows, prev_tokens, penalty_counts, token_mask.rows if token_mask is not None else ())
    fused = logits.is_cuda and st.top_k is None and st.top_p is None and st.min_p is None
    # the fused kernel reads a grammar's mask itself; the other paths (and seeded rows, redrawn
    # from the logits) need it applied to the logits first
    if token_mask is not None and (not fused or st.seeds):
        apply_token_mask(logits, token_mask)
        token_mask = None
    if fused:
        tokens = _fused_draw(logits, st, token_mask)  # applies a grammar's mask in the same pass
    elif st.all_greedy:
        tokens = logits.argmax(dim=-1)  # any float dtype gives the same index
    else:
        tokens = torch.where(st.greedy, logits.argmax(dim=-1), filtered_draw(logits, st))
    if raw_logprobs is None:
        return tokens, None
    return tokens, token_logprobs(tokens, raw_logprobs, st.top_logprobs)


def adjusts_logits(w: SequenceWork) -> bool:
    """Whether the row changes its logits before the draw: penalties, a bias, bans or an allow
    list (apply_penalties)."""
    p = w.params
    return bool(p.uses_penalties or p.logit_bias or w.banned_token_ids or p.allowed_token_ids is not None)


def draws_in_graph(rows: list[SequenceWork]) -> bool:
    """Whether a decode graph's own draw (temperature and Gumbel noise over the whole vocabulary)
    is the draw `draw` makes for every row: no filter, seed, penalty, bias, ban, allow list or logprobs.

    A greedy row ignores its filters and seed in `draw` as well."""
    for w in rows:
        p = w.params
        if p.logprobs is not None or adjusts_logits(w):
            return False
        if p.temperature > 0.0 and (p.top_k != -1 or p.top_p < 1.0 or p.min_p > 0.0 or p.seed is not None):
            return False
    return True


def _fused_draw(logits: torch.Tensor, st: SamplingTensors, token_mask: TokenMask | None = None) -> torch.Tensor:
    """The one-pass Gumbel-max kernel, for rows without top-k / top-p / min-p."""
    from nanoserve.runner.sampling_kernel import gumbel_argmax

    seeds = torch.randint(0, 2**31 - 1, (logits.shape[0],), dtype=torch.int64)
    temperature = st.temperature.masked_fill(st.greedy, 0.0)
    bitmask = mask_rows = None
    if token_mask is not None:
        # each logits row's bitmask row, -1 where it has none; both go up from pinned memory
        host_rows = torch.full((logits.shape[0],), -1, dtype=torch.int32, pin_memory=True)
        host_rows[token_mask.rows] = torch.arange(len(token_mask.rows), dtype=torch.int32)
        mask_rows = host_rows.to(logits.device, non_blocking=True)
        bitmask = token_mask.bitmask.to(logits.device, non_blocking=True)
    tokens = gumbel_argmax(logits, temperature, seeds.to(logits.device, non_blocking=True), bitmask, mask_rows)
    if st.seeds:
        # drawn as the other paths draw them: which path a step takes depends on the rest of the batch
        rows = [row for row, _ in st.seeds]
        probs = (logits[rows].float() / st.temperature[rows, None]).softmax(dim=-1)
        tokens[rows] = race(probs, None, [(i, seed) for i, (_, seed) in enumerate(st.seeds)], logits.shape[1])
    return tokens


def token_logprobs(chosen_ids: torch.Tensor, logprobs: torch.Tensor, top_n: list[int | None]) -> list:
    """Per row: (logprob of chosen_ids[row], [(id, logprob), ...] of its top_n[row] best, rank of
    chosen_ids[row]: 1 + how many tokens the model found more likely), or None where top_n[row] is
    None. Reads the values back to the host."""
    chosen = logprobs.gather(-1, chosen_ids[:, None])
    # the rank travels beside the logprob, as a float (exact below 2**24): one copy to the host, not two
    chosen_and_rank = torch.cat([chosen.clamp(min=MIN_LOGPROB), (logprobs > chosen).sum(-1, keepdim=True) + 1.0], -1)
    top_vals, top_ids = logprobs.topk(max(max((n for n in top_n if n is not None), default=0), 1), dim=-1)
    top_vals = top_vals.clamp(min=MIN_LOGPROB)
    pairs, ids_list, vals_list = chosen_and_rank.tolist(), top_ids.tolist(), top_vals.tolist()
    return [None if n is None else (pairs[i][0], list(zip(ids_list[i][:n], vals_list[i][:n])), int(pairs[i][1]))
            for i, n in enumerate(top_n)]
