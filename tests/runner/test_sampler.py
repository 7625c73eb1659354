"""The sampler: greedy, top-k / top-p / min-p filters, seeds, penalties, logit bias, banned ids, logprobs."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from nanoserve.runner.batch import SequenceWork
from nanoserve.runner.sampler import sample, step_seed
from nanoserve.sampling_params import SEED_RANGE, SamplingParams, fork_seed

VOCAB = 50


def row(params: SamplingParams, prompt: list[int] = (40, 41, 42), output: list[int] = (),
        banned: tuple[int, ...] = ()) -> SequenceWork:
    tokens = list(prompt) + list(output)
    return SequenceWork(tokens, len(prompt), len(tokens) - 1, 1, [0], params, banned)


def padded(logits: list[float], pad: float = -20.0) -> torch.Tensor:
    """Crafted logits for the first tokens; the rest of the vocabulary far below them."""
    return torch.tensor([logits + [pad] * (VOCAB - len(logits))])


def greedy_pick(logits: list[float], params: SamplingParams, **kw) -> int:
    return sample(padded(logits), [row(params, **kw)]).token_ids[0]


def test_temperature_zero_is_argmax():
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(16)]
    assert sample(logits, rows).token_ids == logits.argmax(dim=-1).tolist()
    # greedy rows stay argmax beside sampled rows that use every filter
    mixed = [row(SamplingParams(temperature=0.0)) if i % 2 else
             row(SamplingParams(temperature=1.5, top_k=3, top_p=0.5, min_p=0.2, seed=i)) for i in range(16)]
    picks = sample(logits, mixed).token_ids
    assert picks[1::2] == logits.argmax(dim=-1)[1::2].tolist()


def allowed_tokens(logits: np.ndarray, p: SamplingParams, slack: float = 1e-4) -> set[int]:
    """The tokens a request may draw, by the vLLM / transformers definition, applied in order:
    temperature, then top-k, then top-p over what top-k left (renormalized), then min-p.
    `slack` widens each cut a little so that float rounding at a boundary cannot fail the test."""
    x = logits.astype(np.float64) / p.temperature
    keep = np.ones_like(x, dtype=bool)
    if p.top_k > 0:
        kth = np.sort(x)[::-1][p.top_k - 1]
        keep &= x >= kth - slack
    if p.top_p < 1.0:
        probs = np.where(keep, np.exp(x - x.max()), 0.0)
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        mass_before = np.cumsum(probs[order]) - probs[order]
        keep_p = np.zeros_like(keep)
        keep_p[order[mass_before < p.top_p + slack]] = True
        keep &= keep_p
    if p.min_p > 0.0:
        # relative to the most likely token, so independent of what the other filters removed
        keep &= np.exp(x - x.max()) >= p.min_p * (1 - slack)
    return set(np.flatnonzero(keep).tolist())


FILTERS = [
    SamplingParams(top_k=1),
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.3),
    SamplingParams(top_p=0.8, temperature=0.7),
    SamplingParams(min_p=0.1),
    SamplingParams(min_p=0.3, temperature=1.5),
    SamplingParams(top_k=8, top_p=0.5),
    SamplingParams(top_k=10, top_p=0.6, min_p=0.05, temperature=0.8),
]


@pytest.mark.parametrize("params", FILTERS, ids=lambda p: f"k{p.top_k}-p{p.top_p}-min{p.min_p}-t{p.temperature}")
def test_filters_never_pick_outside_the_allowed_set(params):
    gen = torch.Generator().manual_seed(1)
    # a few near-flat rows and a few peaked ones, so the filters cut at very different ranks
    logits = torch.randn(64, VOCAB, generator=gen) * torch.linspace(0.2, 4.0, 64)[:, None]
    allowed = [allowed_tokens(r, params) for r in logits.numpy()]
    # unfiltered rows in the same batch must not change what the filtered rows may pick
    rows = [row(params) if i % 4 else row(SamplingParams()) for i in range(64)]
    seen = [set() for _ in range(64)]
    for _ in range(40):
        for i, t in enumerate(sample(logits, rows).token_ids):
            seen[i].add(t)
    for i in range(64):
        if i % 4:
            assert seen[i] <= allowed[i], f"row {i} drew {sorted(seen[i] - allowed[i])}"
    if params.top_k != 1:
        assert any(len(seen[i]) > 1 for i in range(64) if i % 4), "nothing was left to draw from"


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    logits = padded([math.log(0.5), math.log(0.3), math.log(0.2)], pad=float("-inf"))
    draws = {sample(logits, [row(SamplingParams(top_p=0.6))]).token_ids[0] for _ in range(200)}
    assert draws == {0, 1}


def test_top_p_applies_to_what_top_k_left():
    # top-k 2 leaves 0.45 / 0.45, i.e. 0.5 / 0.5 renormalized; top-p 0.5 then keeps only the first
    logits = padded([math.log(0.45), math.log(0.45) - 1e-3, math.log(0.1)], pad=float("-inf"))
    draws = {sample(logits, [row(SamplingParams(top_k=2, top_p=0.5))]).token_ids[0] for _ in range(200)}
    assert draws == {0}


def test_min_p_is_relative_to_the_most_likely_token():
    logits = padded([math.log(0.5), math.log(0.3), math.log(0.2)], pad=float("-inf"))
    draws = {sample(logits, [row(SamplingParams(min_p=0.5))]).token_ids[0] for _ in range(200)}
    assert draws == {0, 1}  # 0.2 < 0.5 * 0.5


def run_steps(logits: torch.Tensor, target: SamplingParams, others: list[SamplingParams], position: int,
              steps: int = 8) -> list[int]:
    """Sample `steps` tokens for the target row, growing its output as the engine does."""
    output: list[int] = []
    other_outputs: list[list[int]] = [[] for _ in others]
    for step in range(steps):
        params = list(others)
        params.insert(position, target)
        outputs = list(other_outputs)
        outputs.insert(position, output)
        batch = torch.randn(len(params), VOCAB) * 2
        batch[position] = logits[step]
        tokens = sample(batch, [row(p, output=o) for p, o in zip(params, outputs)]).token_ids
        output.append(tokens[position])
        for o, t in zip(other_outputs, tokens[:position] + tokens[position + 1:]):
            o.append(t)
    return output


def test_seeds_that_python_hashes_alike_draw_apart():
    # hash() folds ints modulo 2^61 - 1 and hashes -1 as -2: those seeds drew the same tokens, and
    # an n = 2 request seeded -2 (choices seeded -2 and -1) got one completion twice
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(3))
    for a, b in ((-1, -2), (5, 5 + 2**61 - 1), (SEED_RANGE[0] + 3, -1), (-2, fork_seed(-2, 1))):
        torch.manual_seed(0)
        # as a fork's seed is set (derived): SamplingParams(seed=-1) is vLLM's "no seed"
        first = run_steps(logits, SamplingParams(temperature=1.0).derived(seed=a), [], 0)
        torch.manual_seed(0)
        assert run_steps(logits, SamplingParams(temperature=1.0).derived(seed=b), [], 0) != first, (a, b)
    # the ends of the seed range and every position give distinct generator seeds (modulo 2^64,
    # as torch takes a seed, the range's top is -1)
    seeds = {step_seed(s, pos) for s in (*SEED_RANGE, -2, 0, 2**61 - 1, 2**61) for pos in range(64)}
    assert len(seeds) == 6 * 64 and all(0 <= s < 2**47 for s in seeds)


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_busy_batch():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=1.0, seed=1234)
    torch.manual_seed(0)
    alone = run_steps(logits, seeded, [], 0)
    busy = [SamplingParams(temperature=0.8), SamplingParams(seed=7), SamplingParams(temperature=0.0),
            SamplingParams(top_k=5, top_p=0.9, seed=99), SamplingParams(min_p=0.2, presence_penalty=1.0)]
    torch.manual_seed(1)
    assert run_steps(logits, seeded, busy, 3) == alone
    torch.manual_seed(2)
    assert run_steps(logits, seeded, busy[:2], 0) == alone
    # the per-step seed moves with the output length: a fixed row does not repeat one draw
    flat = torch.zeros(8, VOCAB)
    assert len(set(run_steps(flat, seeded, [], 0))) > 1
    assert run_steps(logits, SamplingParams(seed=4321), [], 0) != alone


def test_presence_penalty_subtracts_once_for_any_output_occurrence():
    logits = [2.0, 1.5, 0.0, 0.0]
    assert greedy_pick(logits, SamplingParams(temperature=0, presence_penalty=0.4), output=[0, 0, 0]) == 0
    assert greedy_pick(logits, SamplingParams(temperature=0, presence_penalty=0.6), output=[0]) == 1
    # prompt tokens are not penalized
    assert greedy_pick(logits, SamplingParams(temperature=0, presence_penalty=2.0), prompt=[0, 0]) == 0
    # a negative penalty encourages repeats
    assert greedy_pick(logits, SamplingParams(temperature=0, presence_penalty=-1.0), output=[1]) == 1


def test_frequency_penalty_scales_with_the_output_count():
    logits = [2.0, 1.5, 0.0, 0.0]
    params = SamplingParams(temperature=0, frequency_penalty=0.2)
    assert greedy_pick(logits, params, output=[0]) == 0         # 2.0 - 0.2 > 1.5
    assert greedy_pick(logits, params, output=[0, 0, 0]) == 1   # 2.0 - 0.6 < 1.5
    assert greedy_pick(logits, params, prompt=[0, 0, 0, 0, 0]) == 0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert greedy_pick([2.0, 1.5, 0.0], params, prompt=[0]) == 1      # 2.0 / 1.5 < 1.5, prompt counts
    assert greedy_pick([2.0, 1.2, 0.0], params, output=[0]) == 0      # 2.0 / 1.5 > 1.2
    assert greedy_pick([-1.0, -1.4, -9.0], params, prompt=[2], output=[0]) == 1   # -1.5 < -1.4
    assert greedy_pick([-1.0, -1.6, -9.0], params, output=[0, 0, 0]) == 0          # once, not per count
    assert greedy_pick([2.0, 1.5, 0.0], SamplingParams(temperature=0, repetition_penalty=0.5),
                       prompt=[1]) == 1                               # < 1 rewards seen tokens


def test_logit_bias_adds_to_the_logits():
    logits = [2.0, 1.5, 0.0, -1.0]
    assert greedy_pick(logits, SamplingParams(temperature=0, logit_bias={3: 3.5})) == 3
    assert greedy_pick(logits, SamplingParams(temperature=0, logit_bias={3: 2.5})) == 0
    assert greedy_pick(logits, SamplingParams(temperature=0, logit_bias={0: -0.6})) == 1
    # an id outside the vocabulary biases nothing (not a clamped neighbour)
    assert greedy_pick(logits, SamplingParams(temperature=0, logit_bias={10_000: 100.0})) == 0


def test_a_bias_of_minus_100_bans_its_token_whatever_the_repetition_penalty():
    # a repetition penalty of 0.01 makes a seen token's logit of 2 into 200, past an added -100
    params = SamplingParams(temperature=0, repetition_penalty=0.01, logit_bias={0: -100.0})
    assert greedy_pick([2.0, 1.5, 0.0, -1.0], params, output=[0]) == 1
    assert greedy_pick([2.0, 1.5, 0.0, -1.0], SamplingParams(temperature=0, repetition_penalty=0.01,
                                                             logit_bias={0: -99.0}), output=[0]) == 0
    # a row whose every token is banned still samples one (no NaN from a row of -inf)
    everything = {t: -100.0 for t in range(VOCAB)}
    picked = sample(padded([2.0, 1.5]), [row(SamplingParams(temperature=1.0, seed=1, logit_bias=everything))])
    assert 0 <= picked.token_ids[0] < VOCAB


def test_choices_that_share_a_bias_and_an_allow_list_upload_them_once(monkeypatch):
    # the n choices of a request share its params' bias and allow list; each was flattened and
    # uploaded once per row, every step: n=128 with a 131k-entry bias over a 152k vocabulary took
    # ~1 s of host time a step (0.5 s more with the allow list), a stall for every other stream
    from nanoserve.runner import penalties

    uploaded = []
    real = penalties.to_device
    monkeypatch.setattr(penalties, "to_device", lambda a, device: uploaded.append(a.size) or real(a, device))
    vocab, n = 4096, 128
    bias = {t: 0.5 - (t % 7) for t in range(0, vocab, 2)}
    allowed = list(range(1, vocab, 3))
    parent = SamplingParams(n=n, logit_bias=bias, allowed_token_ids=allowed, max_tokens=8)
    rows = [row(parent.derived(seed=i)) for i in range(n)]
    rows.append(row(SamplingParams(logit_bias={5: 2.0})))   # another request's, beside them
    logits = torch.randn(n + 1, vocab, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    expected[:n, list(bias)] += torch.tensor(list(bias.values()))
    expected[n, 5] += 2.0
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[allowed] = False
    expected[:n, outside] = float("-inf")
    penalties.apply_token_choices(logits, rows)
    assert torch.equal(logits, expected)
    # each distinct bias and allow list once (ids, values), and a few numbers per row
    assert sum(uploaded) < 3 * len(bias) + 2 * len(allowed) + 8 * (n + 1)


def test_penalties_leave_other_rows_alone():
    logits = padded([2.0, 1.5, 0.0]).repeat(3, 1)
    rows = [row(SamplingParams(temperature=0), output=[0]),
            row(SamplingParams(temperature=0, presence_penalty=1.0), output=[0]),
            row(SamplingParams(temperature=0, logit_bias={2: 5.0}), output=[0])]
    assert sample(logits, rows).token_ids == [0, 1, 2]


def test_banned_token_ids_are_never_sampled():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(32, VOCAB, generator=gen)
    top = logits.argmax(dim=-1)
    banned = [(int(t), (int(t) + 1) % VOCAB) for t in top]
    rows = [row(SamplingParams(temperature=0.0 if i % 2 else 1.0), banned=b) for i, b in enumerate(banned)]
    for _ in range(30):
        tokens = sample(logits, rows).token_ids
        assert all(t not in b for t, b in zip(tokens, banned))
    logits[:, 5] = 100.0  # even an overwhelming favourite
    assert all(t != 5 for t in sample(logits[:4], [row(SamplingParams(), banned=(5,))] * 4).token_ids)


def test_logprobs_are_of_the_raw_logits_with_sorted_top_n():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, VOCAB, generator=gen) * 2
    raw = logits.log_softmax(dim=-1)
    params = [SamplingParams(temperature=0, logprobs=3, presence_penalty=2.0, logit_bias={7: 5.0}),
              SamplingParams(temperature=0.7, logprobs=0),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, top_k=4, logprobs=5, seed=1)]
    rows = [row(p, output=[int(logits[i].argmax())]) for i, p in enumerate(params)]
    out = sample(logits.clone(), rows)
    assert out.logprobs[2] is None
    for i, n in ((0, 3), (1, 0), (3, 5)):
        chosen, top, rank = out.logprobs[i]
        assert chosen == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-5)
        # 1 + how many tokens the raw logits favour over the pick (the biased pick is not the first)
        assert rank == int((raw[i] > raw[i, out.token_ids[i]]).sum()) + 1
        assert len(top) == n
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert [t for t, _ in top] == raw[i].topk(n).indices.tolist() if n else top == []
        for t, lp in top:
            assert lp == pytest.approx(raw[i, t].item(), abs=1e-5)
    assert out.token_ids[0] == 7  # sampled from the biased logits, reported against the raw ones
    assert out.logprobs[0][2] > 1



def test_token_mask_constrains_only_its_rows():
    from nanoserve.runner.batch import TokenMask

    logits = torch.randn(3, VOCAB)
    allowed = [7, 33]
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    for t in allowed:
        bitmask[0, t // 32] |= 1 << (t % 32)
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(3)]
    out = sample(logits.clone(), rows, TokenMask(bitmask, [1])).token_ids
    assert out[1] == allowed[int(logits[1, allowed].argmax())]
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    sampled = [sample(logits.clone(), [row(SamplingParams(temperature=1.0))] * 3,
                      TokenMask(bitmask.repeat(2, 1), [0, 2]))
               .token_ids for _ in range(20)]
    assert all(s[0] in allowed and s[2] in allowed for s in sampled)


def test_rows_that_all_have_a_small_top_k_draw_from_their_candidates_only(monkeypatch):
    """Every sampled row with top_k set (Qwen3's generation config asks for 20): the draw works on
    each row's k best logits. Same allowed sets as the full path; seeded rows keep their draws
    whatever the batch around them."""
    calls = []
    real = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda t, k, *a, **kw: calls.append(k) or real(t, k, *a, **kw))
    vocab = 2000
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(24, vocab, generator=gen) * torch.linspace(0.3, 4.0, 24)[:, None]
    params = [SamplingParams(top_k=20, top_p=0.95, temperature=0.6), SamplingParams(top_k=3),
              SamplingParams(top_k=40, min_p=0.2, temperature=1.3), SamplingParams(temperature=0.0)]
    rows = [row(params[i % 4]) for i in range(24)]
    seen = [set() for _ in range(24)]
    for _ in range(30):
        for i, t in enumerate(sample(logits, rows).token_ids):
            seen[i].add(t)
    assert calls and set(calls) == {40}   # the largest top-k of the rows that draw
    for i in range(24):
        p = params[i % 4]
        if p.temperature == 0.0:
            assert seen[i] == {int(logits[i].argmax())}
        else:
            assert seen[i] <= allowed_tokens(logits[i].numpy(), p), f"row {i}"
    assert any(len(seen[i]) > 1 for i in range(24) if i % 4 != 3)

    target = SamplingParams(temperature=1.0, top_k=8, seed=11)
    step_logits = torch.randn(6, vocab, generator=gen)
    others = [SamplingParams(top_k=50, seed=3), SamplingParams(top_k=2, top_p=0.5)]

    def draws(batch: list[SamplingParams], at: int) -> list[int]:
        picks = []
        for step in range(6):
            x = torch.randn(len(batch), vocab) * 3
            x[at] = step_logits[step]
            picks.append(sample(x, [row(p, output=[1] * step) for p in batch]).token_ids[at])
        return picks

    alone = draws([target], 0)
    assert draws([others[0], target, others[1]], 1) == alone
    assert len(set(alone)) > 1


def test_a_pending_input_token_is_counted_from_the_previous_launch_on_the_device():
    """Pipelined steps: a decode row's input token is a placeholder on the host; penalties count
    the id the previous launch drew for it (row `prev_row` of its sampled ids)."""
    from nanoserve.runner.penalties import token_counts

    tokens = [40, 41, 3, 3, -1]   # prompt 40 41, outputs 3 3 and a pending one
    work = SequenceWork(tokens, 2, 4, 1, [0], SamplingParams(temperature=0, presence_penalty=1.0), prev_row=1)
    counts, seen = token_counts([work], VOCAB, torch.device("cpu"), torch.tensor([7, 9]))
    assert counts[0, 3] == 2 and counts[0, 9] == 1 and counts[0, 7] == 0 and counts.sum() == 3
    assert seen[0].nonzero().flatten().tolist() == [3, 9, 40, 41]
    # the same as if the host had known the id
    known = SequenceWork([40, 41, 3, 3, 9], 2, 4, 1, [0], work.params)
    want_counts, want_seen = token_counts([known], VOCAB, torch.device("cpu"), None)
    assert torch.equal(counts, want_counts) and torch.equal(seen, want_seen)
    logits = padded([2.0, 1.5, 0.0, 2.2, 0.0, 0.0, 0.0, 0.0, 0.0, 2.4])
    from nanoserve.runner.sampler import draw
    tokens_, _ = draw(logits.clone(), [work], prev_tokens=torch.tensor([7, 9]))
    assert tokens_.tolist() == [0]   # 9 and 3 lose 1.0 each: 2.0 wins


def test_a_graph_takes_only_the_draws_that_need_nothing_but_temperature():
    from nanoserve.runner.sampler import draws_in_graph

    def row(banned=(), **kw):
        return SequenceWork([1, 2], 1, 1, 1, [0], SamplingParams(**kw), banned_token_ids=banned)

    plain = [row(temperature=0.0), row(temperature=0.8), row(temperature=1.0, max_tokens=3, stop=["x"])]
    assert draws_in_graph(plain)
    # a greedy row ignores its filters and seed in the sampler too
    assert draws_in_graph([row(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2, seed=3)])
    for asks_more in (dict(temperature=0.8, top_k=5), dict(temperature=0.8, top_p=0.9),
                      dict(temperature=0.8, min_p=0.1), dict(temperature=0.8, seed=1),
                      dict(temperature=0.0, logprobs=0), dict(temperature=0.0, presence_penalty=0.5),
                      dict(temperature=0.0, frequency_penalty=-0.5), dict(temperature=0.0, repetition_penalty=1.2),
                      dict(temperature=0.0, logit_bias={3: 5.0})):
        assert not draws_in_graph(plain + [row(**asks_more)]), asks_more
    assert not draws_in_graph(plain + [row(banned=(7,), temperature=0.0)])


def test_penalty_counts_kept_between_steps_equal_a_fresh_count_every_step():
    """Sequences join, grow (some with a pending token on the device), leave, and a newcomer
    takes a freed slot; rows without a sequence id count afresh. At every step the kept counts
    equal counting each row's whole history."""
    from nanoserve.runner.penalties import PenaltyCounts, token_counts

    rng = random.Random(4)
    params = SamplingParams(temperature=0, presence_penalty=0.5)
    state = PenaltyCounts()
    seqs = {}   # seq_id -> token list: a prompt of 3-6 ids, then outputs
    prompt_len = {}
    next_id = 0
    for step in range(30):
        if step % 4 == 0 or not seqs:
            seqs[next_id] = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 6))]
            prompt_len[next_id] = len(seqs[next_id])
            next_id += 1
        if step % 7 == 6:
            seqs.pop(min(seqs))   # finished
        rows, prev = [], []
        for seq_id, tokens in seqs.items():
            pending = rng.random() < 0.5 and len(tokens) > prompt_len[seq_id]
            if pending:   # its last token (an output) is still on the device: a placeholder on the host
                prev.append(tokens[-1])
                tokens = tokens[:-1] + [-1]
            rows.append(SequenceWork(tokens, prompt_len[seq_id], len(tokens) - 1, 1, [0], params,
                                     prev_row=len(prev) - 1 if pending else -1, seq_id=seq_id))
        rows.append(SequenceWork([1, 2, 3, 2], 2, 3, 1, [0], params))   # no sequence id
        prev_tokens = torch.tensor(prev or [0])
        kept = token_counts(rows, VOCAB, torch.device("cpu"), prev_tokens, state)
        fresh = token_counts(rows, VOCAB, torch.device("cpu"), prev_tokens)
        assert torch.equal(kept[0], fresh[0]) and torch.equal(kept[1], fresh[1]), f"step {step}"
        for tokens in seqs.values():
            tokens.append(rng.randrange(VOCAB))
    assert len(state.slot_of) == len(seqs) + 1 and state.counts.shape[0] == 64


def test_a_step_reads_only_what_a_sequence_added():
    """The kept counts never read a sequence's history again: a token changed behind them (which a
    real sequence never does) stays counted as it was."""
    from nanoserve.runner.penalties import PenaltyCounts, token_counts

    state = PenaltyCounts()
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    tokens = [40, 41, 5, 5]
    token_counts([SequenceWork(tokens, 2, 3, 1, [0], params, seq_id=7)], VOCAB, torch.device("cpu"), None, state)
    tokens[2] = 6
    tokens.append(8)
    counts, _ = token_counts([SequenceWork(tokens, 2, 4, 1, [0], params, seq_id=7)], VOCAB,
                             torch.device("cpu"), None, state)
    assert counts[0, 5] == 2 and counts[0, 6] == 0 and counts[0, 8] == 1
