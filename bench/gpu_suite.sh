#!/usr/bin/env bash
# One device session: GPU tests, then the benchmarks. Logs go to $OUT (or /tmp/nanoserve-gpu).
# usage: bench/gpu_suite.sh [tests] [tests-a] [tests-b] [throughput] [t256] [topk] [t1024] [eager] [sync] [json] [spy-json] [8b] [tp2] [prefill] [prefill-turns] [decode] [served] [served-asc] [fp8] [trace] [trace-sync] [profile] [gemv] [fp8-sweep] [prefill-sweep] [fp8-warm] [prefill-order] [kernels] [silu] [prefill-graphs] [decode-report] [fp8-steps] [ragged] [launch-order] [ahead] [ahead-steps] [v-layout] [store-steps] [tiles-ab] [prefill-fp8-ab] [split-rule-ab] [pdl] [knobs] [t1024-ab] [prefill-ab] [splits-ab] [gemm-lt] [lt-ab] [waves-ab] [early-loads] [rope-ab] [sum-ab] [chain-ab] [v-store-ab]
# carry .whl (scripts/device_wheels.sh) for the parts that import the engine or the server; served also needs .peers (see bench/served_vs_offline.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/nanoserve-gpu}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
# the device image lacks the engine's message packages (msgspec, pyzmq) and the server's: take them from
# .whl (scripts/device_wheels.sh) where it travelled, so no part fails at its imports
if [ -d .whl ] && ! python3 -c "import msgspec, fastapi" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
parts=${*:-tests throughput decode}
# the GPU suite in two calls of at most 10 minutes: the warm-up and the kernel files, then the rest. Run at once in
# one call they did not fit (dddb71a, one H100, cold caches: the first half took 503 s, the second reached 58 of
# its 87 tests by 595 s); in turn the second took 281 s on the same held machine.
first="tests/gpu/test_warm_up_gpu.py tests/gpu/test_attention_kernels.py tests/gpu/test_fp8_kv_cache_gpu.py tests/gpu/test_small_gemm_gpu.py"
ignore() { for f in "$@"; do echo "--ignore=$f"; done; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$out/gpu.txt"
steps_with() {   # bench/decode_step.py with the arguments after $1, once the Python in $1 has run (a setting changed)
  python3 -c "import runpy, sys
$1
sys.argv = ['decode_step'] + sys.argv[1:]
sys.path.insert(0, 'bench'); runpy.run_path('bench/decode_step.py', run_name='__main__')" "${@:2}"
}
workload_ab() {   # the 256-sequence workload over each cache with switch $1 at 0, then 1; log to $2
  for kv in fp8 auto; do
    for value in 0 1; do
      echo "kv $kv $1=$value" | tee -a "$2"
      env "$1=$value" python3 bench/throughput.py --num-seqs 256 --kv-cache-dtype $kv 2>&1 | tee -a "$2" | grep -E "^throughput|Error"
    done
  done
}
for part in $parts; do
  case $part in
    tests) python3 -m pytest -q -m gpu tests/gpu 2>&1 | tee "$out/tests.log" | tail -25 ;;
    tests-a) python3 -m pytest -q -m gpu $first --durations=12 2>&1 | tee "$out/tests-a.log" | tail -25 ;;
    tests-b) python3 -m pytest -q -m gpu tests/gpu $(ignore $first) --durations=12 2>&1 | tee "$out/tests-b.log" | tail -25 ;;
    throughput) "$0" t256 sync eager t1024 ;;
    topk) python3 bench/throughput.py --num-seqs 256 --top-k 20 --top-p 0.95 --runs 1 2>&1 | tee -a "$out/throughput.log" | grep -E "^throughput|^triton|Error" ;;
    t256) python3 bench/throughput.py --num-seqs 256 2>&1 | tee -a "$out/throughput.log" | grep -E "^throughput|^triton|Error" ;;
    sync) python3 bench/throughput.py --num-seqs 256 --no-async-scheduling 2>&1 | tee -a "$out/throughput.log" | grep -E "^throughput|^triton|Error" ;;
    served) OUT="$out" bash bench/served_vs_offline.sh offline inf rates single 2>&1 | grep -vE "it/s" ;;
    served-asc) # the fp8 workload served by 1, then 2 front-end processes (--api-server-count), 8 client processes
         for asc in 1 2; do echo "== fp8, --api-server-count $asc"
           OUT="$out/served-asc$asc" SERVE_ARGS="--kv-cache-dtype fp8 --api-server-count $asc ${ASC_ARGS:-}" CLIENTS=8 \
             bash bench/served_vs_offline.sh inf 2>&1 | grep -vE "it/s"; done ;;
    spy-json) # where the host's time goes in constrained steps: collapsed stacks of every thread (py-spy from .whl)
          /tmp/site/bin/py-spy record -r 250 --threads --format raw -o /tmp/json-spy.txt -- \
            python3 bench/throughput.py --num-seqs 256 --json-schema --runs 1 2>&1 | grep -E "^throughput|^triton|Error"
          python3 scripts/spy_summary.py /tmp/json-spy.txt --top 60 --within "generate (nanoserve/engine/llm.py)" > "$out/json-spy.txt" ;;
    json) python3 bench/throughput.py --num-seqs 256 --json-schema --runs 1 2>&1 | tee -a "$out/throughput.log" | grep -E "^throughput|^grammar|^triton|Error" ;;
    t1024) python3 bench/throughput.py --num-seqs 1024 2>&1 | tee -a "$out/throughput.log" | grep -E "^throughput|^triton|Error" ;;
    eager) python3 bench/throughput.py --num-seqs 256 --enforce-eager 2>&1 | tee -a "$out/throughput.log" | grep -E "^throughput|^triton|Error" ;;
    tp2) timeout 90 python3 scripts/tp_probe.py 2>&1 | tee "$out/tp-probe.log" | tail -12
         # a stuck test dumps the test process's stacks after 5 minutes
         timeout 480 python3 -m pytest -q -o faulthandler_timeout=300 -m gpu tests/gpu/test_tensor_parallel_gpu.py \
           --durations=3 2>&1 | tee "$out/tests-tp.log" | tail -40
         python3 bench/throughput.py --num-seqs 256 --config bench/configs/qwen3-8b.json --tensor-parallel-size 2 2>&1 | tee -a "$out/throughput.log" | grep -E "^throughput|^triton|Error" ;;
    8b) python3 bench/throughput.py --num-seqs 256 --config bench/configs/qwen3-8b.json 2>&1 | tee -a "$out/throughput.log" | grep -E "^throughput|^triton|Error" ;;
    fp8-sweep) # decode tiles over an e4m3 cache, at GQA groups 2 and 4 (0.6B, 8B)
         python3 -m pytest -q -m gpu tests/gpu/test_fp8_kv_cache_gpu.py 2>&1 | tail -3
         for g in 2 4; do python3 bench/attention_kernels.py --fp8-sweep --group $g 2>&1 | tee "$out/fp8-sweep-g$g.log" | tail -20; done ;;
    prefill-sweep) # prefill tiles for lone prompts, GQA groups 2 and 4 (0.6B, 8B)
         for g in 2 4; do python3 bench/attention_kernels.py --prefill-sweep --group $g 2>&1 | tee "$out/prefill-sweep-g$g.log" | tail -52; done ;;
    fp8-warm) # the fp8 workload's warm runs: at dddb71a (one H100) run 2 did not gain on run 1, where every earlier
         # call gained ~6%; three runs an engine, the prefill launch order on then off, then bf16 beside them
         for flag in 1 0; do echo "kv fp8 NANOSERVE_PREFILL_LONGEST_FIRST=$flag" | tee -a "$out/fp8-warm.log"
           NANOSERVE_PREFILL_LONGEST_FIRST=$flag python3 bench/throughput.py --num-seqs 256 --kv-cache-dtype fp8 --runs 3 \
             2>&1 | tee -a "$out/fp8-warm.log" | grep -E "^throughput|^triton|Error"; done
         python3 bench/throughput.py --num-seqs 256 --runs 3 2>&1 | tee -a "$out/fp8-warm.log" | grep -E "^throughput|^triton|Error" ;;
    prefill-order) # prefill programs longest first and a tile's kv heads side by side, against the old order,
         # by tile config, GQA groups 2 and 4; then lone prompts' TTFT with the order off and on
         for g in 2 4; do python3 bench/attention_kernels.py --prefill-order --group $g 2>&1 | tee "$out/prefill-order-g$g.log" | grep -v Warn; done
         for flag in 0 1 0 1; do echo "NANOSERVE_PREFILL_LONGEST_FIRST=$flag"
           NANOSERVE_PREFILL_LONGEST_FIRST=$flag python3 bench/prefill.py --lengths 1024,2048,4096 --repeats 9 2>&1 \
             | tee -a "$out/prefill-order.log" | grep -vE "it/s|Capturing|Warn"; done ;;
    decode-report) # registers, shared memory and Nsight Compute's view of the decode kernel, bf16 and fp8 caches
         # (REPORT_ARGS="--batch 16" for another shape)
         ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
         for d in bf16 fp8; do
           python3 scripts/decode_kernel_report.py --dtype $d ${REPORT_ARGS:-} --ir "$out/ir" 2>&1 | tee -a "$out/decode-report.txt"
           $ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 2 --launch-count 1 \
             --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
             --section WarpStateStats --section SchedulerStats \
             python3 scripts/decode_kernel_report.py --dtype $d ${REPORT_ARGS:-} 2>&1 | tee -a "$out/decode-report.txt" | grep -E "Duration|Throughput|Occupancy|Stall|Registers|Shared Memory Config|Block Limit" | head -40
         done ;;
    fp8-steps) # fp8 against bf16 cache, step by step: decode steps by batch, and the workload's steps by running count
         for kv in auto fp8; do
           python3 bench/decode_step.py --batch-sizes 1,16,64,128,256 --contexts 1024 --kv-cache-dtype $kv 2>&1 \
             | tee -a "$out/fp8-steps.log" | grep -vE "it/s|Capturing"
           python3 bench/throughput.py --num-seqs 256 --runs 1 --kv-cache-dtype $kv --trace "$out/trace-$kv" 2>&1 \
             | tee -a "$out/fp8-steps.log" | grep -vE "it/s|Capturing"
         done ;;
    ahead) # the decode loop reading each tile's block a tile ahead (A) against the table read per key (-): the
         # kernel at GQA groups 2 and 4, then the 256-sequence workload over each cache, ahead off then on
         for g in 2 4; do python3 bench/attention_kernels.py --ahead --group $g 2>&1 | tee "$out/ahead-g$g.log" | tail -14; done
         for kv in fp8 auto; do
           for ahead in False True; do
             echo "kv $kv BLOCK_AHEAD=$ahead" | tee -a "$out/ahead-ab.log"
             python3 -c "import nanoserve.runner.attention.triton_decode as d
tiles = d.decode_config
d.decode_config = lambda *a, **k: {**tiles(*a, **k), 'BLOCK_AHEAD': $ahead}
from nanoserve.benchmarks.throughput import main; main(['--num-seqs', '256', '--kv-cache-dtype', '$kv'])" 2>&1 \
               | tee -a "$out/ahead-ab.log" | grep -E "^throughput|Error"
           done
         done ;;
    ahead-steps) # decode steps at context 1k with each tile's block read ahead, off then on, over a bf16 cache
         # (its batch-1 kernel read 0.47 -> 0.53 TB/s in the --ahead sweep), then the fp8 default's steps and floor
         for ahead in False True; do
           echo "bf16 BLOCK_AHEAD=$ahead" | tee -a "$out/ahead-steps.log"
           steps_with "import nanoserve.runner.attention.triton_decode as d
tiles = d.decode_config
d.decode_config = lambda *a, **k: {**tiles(*a, **k), 'BLOCK_AHEAD': $ahead}" --batch-sizes 1,16,64,256 --contexts 1024 2>&1 \
             | tee -a "$out/ahead-steps.log" | grep -vE "it/s|Capturing"
         done
         python3 bench/decode_step.py --batch-sizes 1,16,64,256 --contexts 1024 --kv-cache-dtype fp8 2>&1 \
           | tee -a "$out/ahead-steps.log" | grep -vE "it/s|Capturing" ;;
    tiles-ab) # decode tiles over an fp8 cache (V along tokens): the kernel sweep with 256-key tiles and register caps, then
         # the 256-sequence workload with the default tiles against NANOSERVE_DECODE_TILES_FP8's candidates (TILES="default
         # 128,4,2,128" to choose), one process each
         python3 bench/attention_kernels.py --v-layout --group 2 2>&1 | tee "$out/tiles-g2.log" | tail -30
         for tiles in ${TILES:-default 256,4,2 256,8,2}; do
           echo "fp8 decode tiles: $tiles" | tee -a "$out/tiles-ab.log"
           NANOSERVE_DECODE_TILES_FP8=${tiles/default/} python3 bench/throughput.py --num-seqs 256 --kv-cache-dtype fp8 2>&1 \
             | tee -a "$out/tiles-ab.log" | grep -E "^throughput|Error"
         done ;;
    prefill-fp8-ab) # TTFT of one prompt over an fp8 cache: the 64 x 64 tiles on 4 warps used before, then the default
         for old in True False; do
           echo "fp8 prefill on the old 64 x 64 tiles: $old" | tee -a "$out/prefill-fp8-ab.log"
           python3 -c "import runpy, sys
import nanoserve.runner.attention.triton_prefill as p
if $old:
    p._prefill_config = lambda *a: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
sys.argv = ['prefill', '--kv-cache-dtype', 'fp8']
sys.path.insert(0, 'bench'); runpy.run_path('bench/prefill.py', run_name='__main__')" 2>&1 \
             | tee -a "$out/prefill-fp8-ab.log" | grep -vE "it/s|Capturing|Warning|warn"
         done ;;
    split-rule-ab) # fp8 splits by batch: 1,024 keys wherever keys apply (the default), against 1,024 from 192 sequences
         # and SMALL keys below (the ragged sweep at batch 128 had 256-key splits at 2.44 TB/s against 2.28); the workload
         for small in default 256 512; do
           echo "fp8 split keys below 192 sequences: $small" | tee -a "$out/split-rule-ab.log"
           python3 -c "import nanoserve.runner.attention.triton_kernels as t
rule = t.engine_split_keys
if '$small' != 'default':
    t.engine_split_keys = lambda batch, *a: (lambda keys: keys if keys is None or batch >= 192 else int('$small'))(rule(batch, *a))
from nanoserve.benchmarks.throughput import main; main(['--num-seqs', '256', '--kv-cache-dtype', 'fp8'])" 2>&1 \
             | tee -a "$out/split-rule-ab.log" | grep -E "^throughput|Error"
         done ;;
    v-layout) # an fp8 cache's V row by row against along tokens (the default, kv_layout.py): decode tiles and prefill,
         # then the 256-sequence workload with V row by row (the default's own run: t256 with --kv-cache-dtype fp8)
         for g in 2 4; do python3 bench/attention_kernels.py --v-layout --group $g 2>&1 | tee "$out/v-layout-g$g.log" | tail -28; done
         echo "fp8 V row by row" | tee -a "$out/v-layout-ab.log"
         python3 -c "import nanoserve.runner.kv_cache as c
c.v_cache_view = lambda storage, fp8: storage
from nanoserve.benchmarks.throughput import main; main(['--num-seqs', '256', '--kv-cache-dtype', 'fp8'])" 2>&1 \
           | tee -a "$out/v-layout-ab.log" | grep -E "^throughput|Error" ;;
    store-steps) # the fp8 step at batch 256, context 1k, profiled with V along tokens (the default), then row by row:
         # the fused q/k norm + rotary + KV store took 408 us a step against bf16's 97 at 6d10d7d (BENCHMARKS.md)
         args="--batch-sizes 256 --contexts 1024 --kv-cache-dtype fp8 --profile"
         for rows in False True; do
           echo "fp8 V row by row: $rows" | tee -a "$out/store-steps.log"
           steps_with "import nanoserve.runner.kv_cache as c
if $rows: c.v_cache_view = lambda storage, fp8: storage" $args 2>&1 \
             | tee -a "$out/store-steps.log" | grep -vE "it/s|Capturing|Warning|warn"
         done ;;
    launch-order) # decode programs with a sequence's kv heads side by side (the default) against head by head,
         # the kernel for both caches, then the 256-sequence workload each way
         python3 bench/attention_kernels.py --launch-order 2>&1 | tee "$out/launch-order.log" | tail -16
         workload_ab NANOSERVE_DECODE_HEADS_FAST "$out/launch-order-ab.log" ;;
    ragged) # decode over unequal contexts: split counts and longest-first launch order, bf16 and fp8 caches
         python3 bench/attention_kernels.py --ragged 2>&1 | tee "$out/ragged.log" | tail -12 ;;
    chain-ab) # the norms in PDL's chain: torch.compile's add + RMSNorm, then the Triton one (the default); bf16 steps at 1k
         for value in 0 1; do
           echo "NANOSERVE_TRITON_NORM=$value" | tee -a "$out/chain-ab.log"
           NANOSERVE_TRITON_NORM=$value python3 bench/decode_step.py --contexts 1024 \
             --batch-sizes ${CHAIN_BATCHES:-1,4,16,32,64,128,256} 2>&1 | tee -a "$out/chain-ab.log" | grep -vE "it/s|Capturing"
         done ;;
    sum-ab) # split-K partials summed by a second kernel, then by the last split of each tile (the default):
         # bf16 steps at 1k, then the same with --profile at 16
         for last in False True; do
           for extra in "--batch-sizes 1,4,8,16,32,64" "--batch-sizes 16 --profile"; do
             echo "sum in the last split $last: $extra" | tee -a "$out/sum-ab.log"
             steps_with "import nanoserve.runner.layers.split_k_sum as g
g.SUM_IN_LAST_SPLIT = $last" --contexts 1024 $extra 2>&1 \
               | tee -a "$out/sum-ab.log" | grep -vE "it/s|Capturing"
           done
         done ;;
    early-loads) # loads before the PDL wait, off then on: the skinny GEMM's first weight tile (1-2 rows) and the
         # decode kernel's L2 prefetch of its first K/V tile, each alone and both (the default); bf16 steps at 1k
         for loads in "False False" "True False" "False True" "True True"; do
           set -- $loads
           echo "skinny first tile $1, decode prefetch $2" | tee -a "$out/early-loads.log"
           steps_with "import nanoserve.runner.layers.small_gemm as g, nanoserve.runner.attention.triton_decode as d
g.PRELOAD_FIRST_TILE, d.PREFETCH_FIRST_TILE = $1, $2" --batch-sizes 1,2,16,256 --contexts 1024 2>&1 \
             | tee -a "$out/early-loads.log" | grep -vE "it/s|Capturing"
         done ;;
    rope-ab) # a decode-only step's q/k norm, rotary and K/V store in their own launch, then inside the decode
         # kernel (the default, at batch 1 only since the run of cdbfc62 that took it at every batch): its GPU
         # tests, decode steps at 1k over both caches, then the 256-sequence workload
         timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_rope_store_gpu.py tests/gpu/test_model_gpu.py 2>&1 \
           | tee "$out/tests-rope.log" | tail -4
         for rope in 0 1; do
           for kv in auto fp8; do
             echo "NANOSERVE_DECODE_ROPE=$rope kv $kv" | tee -a "$out/rope-ab.log"
             NANOSERVE_DECODE_ROPE=$rope python3 bench/decode_step.py --batch-sizes 1,16,256 --contexts 1024 \
               --kv-cache-dtype $kv 2>&1 | tee -a "$out/rope-ab.log" | grep -vE "it/s|Capturing"
           done
         done
         workload_ab NANOSERVE_DECODE_ROPE "$out/rope-ab-workload.log" ;;
    v-store-ab) # an fp8 decode-only step's new v stored by the decode kernel, a whole sector a dim (opt-in),
         # against the q/k norm + rotary + store kernel's single bytes: GPU tests, fp8 decode steps at 1k, the fp8 workload
         timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_rope_store_gpu.py \
           tests/gpu/test_fp8_kv_cache_gpu.py::test_triton_decode_over_fp8_under_cuda_graph_replay \
           tests/gpu/test_fp8_kv_cache_gpu.py::test_bundled_model_fp8_cache_picks_the_auto_caches_greedy_token_at_90_percent_of_steps \
           2>&1 | tee "$out/tests-v-store.log" | tail -4
         for value in 0 1; do
           echo "NANOSERVE_DECODE_STORES_V=$value" | tee -a "$out/v-store-ab.log"
           NANOSERVE_DECODE_STORES_V=$value python3 bench/decode_step.py --batch-sizes 1,16,256 --contexts 1024 \
             --kv-cache-dtype fp8 2>&1 | tee -a "$out/v-store-ab.log" | grep -vE "it/s|Capturing"
         done
         for value in 0 1; do
           echo "kv fp8 NANOSERVE_DECODE_STORES_V=$value" | tee -a "$out/v-store-ab.log"
           NANOSERVE_DECODE_STORES_V=$value python3 bench/throughput.py --num-seqs 256 --kv-cache-dtype fp8 2>&1 \
             | tee -a "$out/v-store-ab.log" | grep -E "^throughput|Error"
         done ;;
    pdl) # programmatic dependent launch off, then on (the default)
         python3 -m pytest -q -m gpu tests/gpu/test_pdl_gpu.py 2>&1 | tail -3
         for pdl in 0 1; do
           echo "NANOSERVE_PDL=$pdl" | tee -a "$out/pdl.log"
           NANOSERVE_PDL=$pdl python3 bench/decode_step.py --batch-sizes 1,2,16,64,256 \
             --contexts 1024 2>&1 | tee -a "$out/pdl.log" | grep -vE "it/s|Capturing"
         done ;;
    t1024-ab) # 1,024 sequences fell 12% between 7e004e8 and 25ec76c: the default, then prefill graphs off, then PDL off (with --trace splits)
         for flags in "" "--no-prefill-cuda-graphs" "NANOSERVE_PDL=0"; do
           echo "1024 ${flags:-default}" | tee -a "$out/t1024-ab.log"
           case $flags in NANOSERVE_*) envs=$flags; args="" ;; *) envs=""; args=$flags ;; esac
           env $envs python3 bench/throughput.py --num-seqs 1024 $args --trace "$out/trace-1024${flags:+-${flags//[^a-zA-Z0-9]/}}" 2>&1 \
             | tee -a "$out/t1024-ab.log" | grep -E "^throughput|^[0-9]+ steps|Error"
         done
         echo "1024 mixed steps unsplit" | tee -a "$out/t1024-ab.log"
         python3 -c "import sys; sys.argv[0] = 'throughput'; import nanoserve.runner.attention.triton_kernels as t
t.MIXED_MIN_DECODE_ROWS = 1 << 30
from nanoserve.benchmarks.throughput import main; main(['--num-seqs', '1024', '--trace', '$out/trace-1024-unsplit'])" 2>&1 \
           | tee -a "$out/t1024-ab.log" | grep -E "^throughput|^[0-9]+ steps|Error" ;;
    prefill-ab) # a lone prompt's TTFT from the prompts-only graphs (the default), then from the mixed ones sized for 256 sequences
         python3 bench/prefill.py --lengths 1024,4096 --max-num-seqs 256 2>&1 | tee -a "$out/prefill-ab.log" | grep -vE "it/s|Capturing"
         python3 -c "import sys; sys.argv = ['prefill', '--lengths', '1024,4096', '--max-num-seqs', '256']
import nanoserve.runner.prefill_graph as g; g.PROMPT_GRAPH_SEQS = 0
sys.path.insert(0, 'bench'); import runpy; runpy.run_path('bench/prefill.py', run_name='__main__')" 2>&1 \
           | tee -a "$out/prefill-ab.log" | grep -vE "it/s|Capturing" ;;
    splits-ab) # decode steps at small batches with splits of at least 64 keys, then of 256 (the default)
         python3 bench/attention_kernels.py --splits 2>&1 | tee "$out/splits.log" | sed -n '/split sweep/,$p'
         for min in 64 256; do
           echo "MIN_TOKENS_PER_SPLIT=$min" | tee -a "$out/splits-ab.log"
           steps_with "import nanoserve.runner.attention.decode_splits as d; d.MIN_TOKENS_PER_SPLIT = $min" --batch-sizes 1,4,16,64 --contexts 1024,4096 2>&1 \
             | tee -a "$out/splits-ab.log" | grep -vE "it/s|Capturing"
         done ;;
    lt-ab) # cuBLASLt where it timed faster at startup (the default), then cuBLAS throughout: the 8B workload
         # (LT_CONFIGS="qwen3-8b qwen3-0.6b" for the 0.6B one too)
         for config in ${LT_CONFIGS:-qwen3-8b}; do
           for lt in default off; do
             echo "$config cuBLASLt choice $lt" | tee -a "$out/lt-ab.log"
             python3 -c "import logging, sys; logging.basicConfig(level=logging.INFO)
import nanoserve.runner.layers.blas_choice as b
if '$lt' == 'off': b.lt_row_counts = lambda sizes: []
from nanoserve.benchmarks.throughput import main; main(['--num-seqs', '256', '--config', 'bench/configs/$config.json'])" 2>&1 \
               | tee -a "$out/lt-ab.log" | grep -E "^throughput|cuBLASLt for|Error"
           done
         done ;;
    waves-ab) # decode splits sized for 4 programs an SM, then 2 (the default from this entry's first run), then 1:
         # steps by batch, then the workload
         for waves in 4 2 1; do
           echo "WAVES=$waves" | tee -a "$out/waves-ab.log"
           steps_with "import nanoserve.runner.attention.decode_splits as d; d.WAVES = $waves" --batch-sizes 4,8,16,32,48,64,96 --contexts 1024,2048 2>&1 \
             | tee -a "$out/waves-ab.log" | grep -vE "it/s|Capturing"
           for kv in auto fp8; do
             python3 -c "import nanoserve.runner.attention.decode_splits as d; d.WAVES = $waves
from nanoserve.benchmarks.throughput import main; main(['--num-seqs', '256', '--kv-cache-dtype', '$kv'])" 2>&1 \
               | tee -a "$out/waves-ab.log" | grep -E "^throughput|Error"
           done
         done ;;
    knobs) # the workload at 256 with and without the ragged-decode switches, both caches, one process each: row
         # order with even splits; longest first alone; longest first with fixed splits (the fp8 default's 1,024 keys)
         for kv in auto fp8; do
           for env in "NANOSERVE_LONGEST_FIRST=0 NANOSERVE_DECODE_SPLIT_KEYS=0" \
                      "NANOSERVE_LONGEST_FIRST=1 NANOSERVE_DECODE_SPLIT_KEYS=0" \
                      "NANOSERVE_LONGEST_FIRST=1 NANOSERVE_DECODE_SPLIT_KEYS=${KNOB_SPLIT_KEYS:-1024}"; do
             echo "$env kv $kv" | tee -a "$out/knobs.log"
             env $env python3 bench/throughput.py --num-seqs 256 --kv-cache-dtype $kv 2>&1 | tee -a "$out/knobs.log" \
               | grep -E "^throughput|Error" | sed 's/(256 seqs.*run/(run/'
           done
         done ;;
    gemv) python3 bench/skinny_gemm.py 2>&1 | tee "$out/skinny_gemm.log" ;;
    gemm-lt) # linear layers at the workload's batches: cuBLAS as torch picks it, against torch's cuBLASLt preference;
         # then the 8B workload under each (torch reads TORCH_BLAS_PREFER_CUBLASLT at start)
         python3 bench/skinny_gemm.py --rows 1,16,64,128,192,256 --blas-lt 2>&1 | tee "$out/gemm-lt.log" | grep -E "M=|done"
         for lt in 0 1; do
           echo "TORCH_BLAS_PREFER_CUBLASLT=$lt" | tee -a "$out/gemm-lt.log"
           TORCH_BLAS_PREFER_CUBLASLT=$lt python3 bench/throughput.py --num-seqs 256 --config bench/configs/qwen3-8b.json 2>&1 \
             | tee -a "$out/gemm-lt.log" | grep -E "^throughput|Error"
         done ;;
    silu) python3 bench/silu_mul.py 2>&1 | tee "$out/silu_mul.log" ;;
    prefill-graphs) # TTFT with prefill steps eager, then replayed from graphs; throughput with them off (t256: on)
         for flag in --no-prefill-cuda-graphs --prefill-cuda-graphs; do
           python3 bench/prefill.py --lengths 128,1024,4096 $flag 2>&1 | tee -a "$out/prefill-graphs.log" | grep -vE "it/s|Capturing"
         done
         python3 bench/throughput.py --num-seqs 256 --no-prefill-cuda-graphs 2>&1 | tee -a "$out/throughput.log" | grep -E "^throughput|^triton|Error" ;;
    prefill-turns) # a conversation's next turn: new tokens after 4,096 cached ones (split prefill programs)
         python3 bench/prefill.py --cached 4096 --lengths 64,512,1024 --repeats 9 2>&1 | tee "$out/prefill-turns.log" \
           | grep -vE "it/s|Capturing"
         # the same turns admitted beside 4 decoding streams (a mixed step), key splits allowed and refused
         python3 bench/prefill.py --cached 4096 --lengths 64,512 --repeats 9 --beside 4 2>&1 \
           | tee -a "$out/prefill-turns.log" | grep -vE "it/s|Capturing" ;;
    prefill) python3 bench/prefill.py --host --profile --trace "$out/prefill-trace" 2>&1 | tee "$out/prefill.log" | grep -vE "it/s|Capturing"
             python3 bench/prefill.py --config bench/configs/qwen3-8b.json 2>&1 | tee -a "$out/prefill.log" | grep -vE "it/s|Capturing" ;;
    decode) python3 bench/decode_step.py 2>&1 | tee "$out/decode_step.log" | grep -vE "it/s|Capturing" ;;
    kernels) # kernels per decode step and GPU time by kernel, batch 1 and 256 at context 1k
         python3 bench/decode_step.py --profile --batch-sizes 1,256 --contexts 1024 2>&1 | tee "$out/decode_profile.log" \
           | grep -vE "it/s|Capturing" | head -80 ;;
    fp8) python3 -m pytest -q -m gpu tests/gpu/test_fp8_kv_cache_gpu.py -s 2>&1 | tee "$out/tests-fp8.log" | tail -5
         python3 bench/attention_kernels.py --kv-cache-dtype fp8 2>&1 | tee "$out/attention-fp8.log" | tail -15
         python3 bench/decode_step.py --kv-cache-dtype fp8 2>&1 | tee "$out/decode_step-fp8.log" | grep -vE "it/s|Capturing"
         python3 bench/throughput.py --num-seqs 256 --kv-cache-dtype fp8 2>&1 | tee -a "$out/throughput.log" | grep -E "^throughput|^triton|Error"
         python3 bench/throughput.py --num-seqs 256 --config bench/configs/qwen3-8b.json --kv-cache-dtype fp8 2>&1 | tee -a "$out/throughput.log" | grep -E "^throughput|^triton|Error" ;;
    trace) python3 bench/throughput.py --num-seqs 256 --trace "$out/trace" 2>&1 | tee "$out/trace.log" | grep -vE "it/s|Capturing" ;;
    trace-sync) python3 bench/throughput.py --num-seqs 256 --no-async-scheduling --trace "$out/trace-sync" 2>&1 | tee "$out/trace-sync.log" | grep -vE "it/s|Capturing" ;;
    profile) python3 -m cProfile -s tottime bench/throughput.py --num-seqs 256 2>&1 | head -60 | tee "$out/profile.log" ;;
  esac
done
