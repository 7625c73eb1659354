"""allowed_token_ids in the sampler: every path draws from the allowed ids alone, logprobs stay raw."""

from __future__ import annotations

import pytest
import torch

from nanoserve.runner.batch import SequenceWork, TokenMask
from nanoserve.runner.penalties import apply_token_choices
from nanoserve.runner.sampler import draws_in_graph, sample
from nanoserve.sampling_params import InvalidSamplingParam, SamplingParams

VOCAB = 50


def row(params: SamplingParams, banned: tuple[int, ...] = ()) -> SequenceWork:
    return SequenceWork([40, 41, 42, 7], 3, 3, 1, [0], params, banned)


def allowed_sets(rows: int, size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randperm(VOCAB, generator=gen)[:size].tolist() for _ in range(rows)]


# one of each path: greedy, the exponential race over the whole vocabulary, top-k candidates,
# the sorted vocabulary (top-p), min-p, seeds, penalties and a bias towards a token outside the list
PATHS = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.5, top_k=3),
         dict(temperature=1.0, top_p=0.9), dict(temperature=1.0, min_p=0.05), dict(temperature=0.8, seed=5),
         dict(temperature=0.0, presence_penalty=2.0, repetition_penalty=1.5),
         dict(temperature=1.0, frequency_penalty=-2.0), dict(temperature=0.0, logprobs=3)]


@pytest.mark.parametrize("params", PATHS, ids=[",".join(p) for p in PATHS])
def test_every_path_draws_only_allowed_ids(params):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, VOCAB, generator=gen) * 4
    allowed = allowed_sets(16, 4, seed=2)
    outside = [next(t for t in range(VOCAB) if t not in ids) for ids in allowed]
    rows = [row(SamplingParams(**params, allowed_token_ids=ids, logit_bias={out: 100.0}))
            for ids, out in zip(allowed, outside)]
    for _ in range(20):
        tokens = sample(logits.clone(), rows).token_ids
        assert all(t in ids for t, ids in zip(tokens, allowed)), (tokens, allowed)


def test_greedy_takes_the_best_allowed_id_and_rows_without_a_list_are_untouched():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(32, VOCAB, generator=gen) * 3
    allowed = allowed_sets(32, 5, seed=4)
    rows = [row(SamplingParams(temperature=0.0, allowed_token_ids=ids if i % 2 else None))
            for i, ids in enumerate(allowed)]
    tokens = sample(logits.clone(), rows).token_ids
    for i, ids in enumerate(allowed):
        best = max(ids, key=lambda t: logits[i, t].item()) if i % 2 else int(logits[i].argmax())
        assert tokens[i] == best
    # the list matters: the unrestricted argmax is outside it for some rows
    assert any(int(logits[i].argmax()) not in allowed[i] for i in range(1, 32, 2))


def test_logprobs_are_the_models_own_not_those_of_the_masked_logits():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    raw = logits.log_softmax(dim=-1)[0]
    out = sample(logits.clone(), [row(SamplingParams(temperature=0.0, logprobs=2, allowed_token_ids=[9, 11]))])
    chosen, top, rank = out.logprobs[0]
    assert out.token_ids[0] in (9, 11)
    assert rank == int((raw > raw[out.token_ids[0]]).sum()) + 1
    assert chosen == pytest.approx(raw[out.token_ids[0]].item(), abs=1e-5)
    assert [t for t, _ in top] == raw.topk(2).indices.tolist()


def test_a_ban_wins_over_the_allow_list():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 10.0
    out = sample(logits, [row(SamplingParams(temperature=0.0, allowed_token_ids=[3, 4]), banned=(3,))])
    assert out.token_ids == [4]


def test_a_grammar_row_takes_its_allow_list_from_the_bitmask_not_the_sampler():
    """The engine folds a constrained row's list into the grammar's bitmask (keeping the grammar's
    tokens where the two share none): the sampler must not mask that row a second time."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 20] = 5.0
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    bitmask[0, 0] = 1 << 6   # the grammar allows token 6 alone
    rows = [row(SamplingParams(temperature=0.0, allowed_token_ids=[7])) for _ in range(2)]
    out = sample(logits, rows, TokenMask(bitmask, [0]))
    assert out.token_ids == [6, 7]


def test_a_full_step_is_masked_by_flat_index_writes():
    """256 rows, each with its own list, bias and ban: the same logits as applying them row by row."""
    vocab, n = 1000, 256
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(n, vocab, generator=gen)
    rows = []
    for i in range(n):
        ids = torch.randperm(vocab, generator=gen)[:1 + i % 40].tolist()
        rows.append(SequenceWork([1, 2], 1, 1, 1, [0], SamplingParams(
            allowed_token_ids=ids if i % 3 else None, logit_bias={i % vocab: 1.5, 999: -2.0} if i % 2 else None),
            banned_token_ids=(i % 7, 500) if i % 5 == 0 else ()))
    expected = logits.clone()
    for i, w in enumerate(rows):
        for t, b in (w.params.logit_bias or {}).items():
            expected[i, t] += b
        expected[i, list(w.banned_token_ids)] = float("-inf")
        if w.params.allowed_token_ids is not None:
            keep = torch.full((vocab,), float("-inf"))
            keep[w.params.allowed_token_ids] = 0.0
            expected[i] += keep
    got = logits.clone()
    apply_token_choices(got, rows)
    assert torch.equal(got, expected)


def test_a_graph_never_draws_for_a_row_with_an_allow_list():
    plain = SequenceWork([1, 2], 1, 1, 1, [0], SamplingParams(temperature=0.8))
    listed = SequenceWork([1, 2], 1, 1, 1, [0], SamplingParams(temperature=0.0, allowed_token_ids=[1, 2]))
    assert draws_in_graph([plain]) and not draws_in_graph([plain, listed])


@pytest.mark.parametrize("ids", [[], [-1], [5, 2**31]])
def test_sampling_params_refuse_an_empty_or_negative_list(ids):
    with pytest.raises(InvalidSamplingParam) as caught:
        SamplingParams(allowed_token_ids=ids)
    assert caught.value.param == "allowed_token_ids"
