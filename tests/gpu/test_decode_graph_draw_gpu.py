"""The draw inside a decode CUDA graph: the same token the sampling kernel draws from the graph's
logits, and the runner's own sampler wherever a row asks for more than temperature."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.runner.batch import SequenceWork
from nanoserve.runner.sampling_kernel import gumbel_argmax
from tests.conftest import random_prompts

pytestmark = pytest.mark.gpu


def _decode_step(runner, prompts, params):
    """Prefill all but each prompt's last token, then one decode step of the rest (a graph replay)."""
    prefill = [SequenceWork(ids, len(ids), 0, len(ids) - 1, [i], None) for i, ids in enumerate(prompts)]
    runner.run(prefill)
    decode = [SequenceWork(ids, len(ids), len(ids) - 1, 1, [i], p)
              for i, (ids, p) in enumerate(zip(prompts, params))]
    assert runner.graphs.fits(decode)
    return runner.run(decode).token_ids


@pytest.fixture(scope="module")
def runner(qwen3_06b):
    llm = LLM(qwen3_06b, dtype="bfloat16", device="cuda", max_model_len=512, max_num_seqs=16,
              num_kvcache_blocks=16)
    assert llm.engine.runner.graphs.draws
    return llm.engine.runner


def test_in_graph_draw_is_the_kernels_draw_over_the_graphs_logits(runner):
    prompts = random_prompts(5, 10000, 20, 200, seed=31)
    temps = [0.8, 0.0, 1.3, 0.5, 1.0]
    ids = _decode_step(runner, prompts, [SamplingParams(temperature=t) for t in temps])
    graphs, n = runner.graphs, len(prompts)
    # the seeds this step staged are still in the buffer (the batch's bucket is 8: rows 5-7 pad)
    want = gumbel_argmax(graphs.logits[:n], torch.tensor(temps, device="cuda"), graphs.buffers.dev_i64[3, :n])
    assert ids == want.tolist()
    assert ids[1] == graphs.logits[1].argmax().item()


def test_rows_asking_for_filters_or_logprobs_take_the_runners_sampler(runner):
    prompts = random_prompts(4, 10000, 20, 200, seed=32)
    params = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=5.0, min_p=0.5), SamplingParams(temperature=2.0, seed=9)]
    ids = _decode_step(runner, prompts, params)
    logits = runner.graphs.logits[:len(prompts)].float()
    assert ids[0] in logits[0].topk(3).indices.tolist()
    assert ids[1] == logits[1].argmax().item()
    probs = (logits[2] / 5.0).softmax(-1)
    assert probs[ids[2]] >= 0.5 * probs.max()
    # a seeded row draws from its own generator whatever shares its step (here: nothing)
    assert _decode_step(runner, prompts[3:], params[3:]) == ids[3:]
