"""No attention kernel compiles while requests run: the eager mixed steps (prompts beside 32 or
more decode rows, outside the prefill graphs) and, under enforce_eager, the eager decode steps
launch kernel variants that no graph capture and no profiling step launches, and the startup
warm-up compiles them first.

Each case runs in a fresh process: kernels an earlier test compiled in this one would hide a
compile that a server would pay."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")

SCRIPT = r"""
import json, sys
import torch
from nanoserve import LLM, SamplingParams
from nanoserve.benchmarks.compile_watch import triton_compiles
from nanoserve.runner.attention.decode_splits import num_decode_splits, num_sms
from tests.conftest import random_prompts

# a fixed cache, room for every sequence at once (no preemption): compiles do not depend on its size
llm = LLM(sys.argv[1], device="cuda", max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=700,
          num_kvcache_blocks=256, kv_cache_dtype=sys.argv[2], prefill_cuda_graphs=False,
          enforce_eager=sys.argv[3] == "eager")
runner = llm.engine.runner
eager, mixed = runner._forward_eager, []

def counted(work):
    decode_rows = sum(w.num_new == 1 for w in work)
    if decode_rows >= 32 and max(w.num_new for w in work) > 1:
        longest = max(w.start + w.num_new for w in work)
        mixed.append(num_decode_splits(len(work), 8, longest, num_sms(torch.device("cuda")), sys.argv[2] == "fp8"))
    return eager(work)

runner._forward_eager = counted
# 700-token steps admit a few prompts each, so later prompts join 32 to 63 running sequences
prompts = random_prompts(60, 10000, 150, 600, seed=5)
params = SamplingParams(temperature=0.8, max_tokens=160, ignore_eos=True)
with triton_compiles() as compiles:
    llm.generate(prompts, params, use_tqdm=False)
print(json.dumps({"compiles": sorted(compiles), "mixed": mixed}))
"""


@pytest.mark.parametrize("kv_cache_dtype,steps", [("auto", "graphs"), ("fp8", "graphs"), ("auto", "eager")])
def test_eager_steps_compile_nothing_while_serving(qwen3_06b, kv_cache_dtype, steps):
    done = subprocess.run([sys.executable, "-c", SCRIPT, qwen3_06b, kv_cache_dtype, steps], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["mixed"], "the workload ran no eager mixed step with 32+ decode rows"
    if kv_cache_dtype == "fp8":   # over bf16 such rows fill the GPU unsplit (decode_splits.WAVES)
        assert max(result["mixed"]) > 1, "no eager mixed step split its decode rows' keys"
    attention = [name for name in result["compiles"] if name in ("_prefill_kernel", "_decode_kernel",
                                                                 "_merge_splits_kernel")]
    assert attention == [], f"compiled while serving: {result['compiles']}"
