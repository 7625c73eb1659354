#!/usr/bin/env bash
# The front end's CPU per streamed token: `nanoserve serve` (the bundled model unless MODEL is set)
# under `nanoserve bench serving`, the server process's user+system CPU read from /proc around the run.
#   bash bench/front_end_cpu.sh [SERVE FLAGS...]      e.g. bash bench/front_end_cpu.sh --stream-interval 8
# N (256) requests, prompts 16-64 ids, outputs 100-300 tokens, all sent at once.
set -euo pipefail
PORT=${PORT:-8123}
N=${N:-256}
nanoserve serve ${MODEL:-} --host 127.0.0.1 --port "$PORT" --max-num-seqs 256 --num-kvcache-blocks 4096 \
  --disable-log-requests "$@" > /tmp/front_end_cpu.log 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null' EXIT
for _ in $(seq 1 240); do curl -sf "127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.5; done
cpu() { awk '{print $14 + $15}' "/proc/$PID/stat"; }   # clock ticks
before=$(cpu)
nanoserve bench serving --url "http://127.0.0.1:$PORT" --num-requests "$N" --min-input-len 16 --max-input-len 64 \
  --min-output-len 100 --max-output-len 300 --temperature 0.6 > /tmp/front_end_cpu.bench
after=$(cpu)
head -1 /tmp/front_end_cpu.bench
tokens=$(head -1 /tmp/front_end_cpu.bench | sed -E 's/.* ([0-9]+) output tokens.*/\1/')
ticks=$(getconf CLK_TCK)
python3 -c "s = ($after - $before) / $ticks; print(f'front end: {s:.2f} s of CPU for $tokens tokens, {1e6 * s / $tokens:.1f} us a token ($*)')"
