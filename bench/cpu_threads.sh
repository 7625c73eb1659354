#!/usr/bin/env bash
# CPU serving with the engine on torch's default threads less one (serve's default) and on every
# core (OMP_NUM_THREADS=N), servers started one after another, each round on its own prompts.
# usage: bash bench/cpu_threads.sh [ROUNDS]   (the bundled model on the CPU; port 8766)
set -u
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
cores=$("$python" -c "import torch; print(torch.get_num_threads())")
for round in $(seq "${1:-2}"); do
  for threads in default "$cores"; do
    env $([ "$threads" = default ] || echo "OMP_NUM_THREADS=$threads") "$python" -m nanoserve.cli serve --device cpu \
      --port 8766 --disable-log-requests > /tmp/cpu-threads-server.log 2>&1 &
    server=$!
    for _ in $(seq 300); do curl -sf http://127.0.0.1:8766/health > /dev/null && break; sleep 0.3; done
    echo "== engine threads: $threads, round $round"
    "$python" -m nanoserve.cli bench serving --url http://127.0.0.1:8766 --num-requests 48 --max-concurrency 16 \
      --min-input-len 32 --max-input-len 256 --min-output-len 32 --max-output-len 64 --seed "$round${#threads}" 2>&1 \
      | grep -E "serving:|ttft|tpot|itl"
    kill -TERM "$server"; wait "$server"
  done
done
