"""The n-1 siblings of a request start from its checked params: their own seeds, nothing checked again."""

from __future__ import annotations

import pytest

from nanoserve import SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling_params import fork_seed


def test_forks_share_the_checked_params_and_differ_only_in_their_seeds(qwen3_model, monkeypatch):
    engine = LLMEngine(EngineConfig(model=qwen3_model, device="cpu", dtype="float32"))
    params = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=3, ignore_eos=True,
                            logit_bias={t: 0.5 for t in range(300)}, prompt_logprobs=1)
    forks = ["r.1", "r.2", "r.3"]
    engine.add_request("r", [5, 6, 7, 8], params, forks)
    # each check walks the whole logit_bias: over a 150k vocabulary ~25 ms, in the engine's loop
    checks = []
    check = SamplingParams.__post_init__
    monkeypatch.setattr(SamplingParams, "__post_init__", lambda self: checks.append(1) or check(self))
    for _ in range(10):
        engine.step()
        if all(f in engine.sequences for f in forks):
            break
    started = [engine.sequences[f].params for f in forks]
    assert [p.seed for p in started] == [fork_seed(11, i) for i in (1, 2, 3)]
    assert all(p.logit_bias is params.logit_bias and p.prompt_logprobs is None for p in started)
    assert checks == []   # the copy without prompt_logprobs and each seed are derived, not checked again


def test_derived_params_name_only_their_own_fields():
    params = SamplingParams(seed=3, logit_bias={1: 1.0})
    derived = params.derived(seed=4, prompt_logprobs=None)
    assert (derived.seed, params.seed) == (4, 3) and derived.logit_bias is params.logit_bias
    with pytest.raises(TypeError, match="sed"):
        params.derived(sed=4)
