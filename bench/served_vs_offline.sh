#!/usr/bin/env bash
# Offline and HTTP throughput side by side, on one model folder, in one device call.
# usage (device, repo root; needs the server wheels, scripts/device_wheels.sh, on PYTHONPATH and a
# copy of ../shared/peers at .peers for the random-weight model folder):
#   bash bench/served_vs_offline.sh [offline] [inf] [rates] [single] [decode]
# Logs go to $OUT. Each HTTP run draws its own prompts (--seed), so none finds another's in the prefix
# cache. Same settings on both paths: nano-vllm's workload, max_model_len 4096,
# max_num_seqs 512, max_num_batched_tokens 16384.
set -u
out=${OUT:-/tmp/served}; mkdir -p "$out"
MODEL=${MODEL:-/tmp/qwen3-0.6b}
PORT=${PORT:-8123}
CLIENTS=${CLIENTS:-4}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
parts=${*:-offline inf rates single}
[ -f "$MODEL/model.safetensors" ] || python3 .peers/make_model.py "$MODEL" | tail -n 1
settings="--max-model-len 4096 --max-num-seqs 512 --max-num-batched-tokens 16384"
bench() { python3 -m nanoserve.cli bench serving --url "http://127.0.0.1:$PORT" --max-token-id 10000 "$@"; }
# CPU seconds (user + system) of the front end and of its engine process, to see which one is busy
cpu() { for pid in $server $(pgrep -P "$server" -f spawn_main); do
          awk -v p="$pid" '{printf "pid %s: %.1f s CPU  ", p, ($14 + $15) / 100}' "/proc/$pid/stat"; done; echo; }

start_server() {
  python3 -m nanoserve.cli serve "$MODEL" --port "$PORT" $settings --disable-log-requests ${SERVE_ARGS:-} \
    > "$out/server.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return 0; sleep 0.5; done
  echo "server did not start"; tail -20 "$out/server.log"; return 1
}

for part in $parts; do
  case $part in
    offline) python3 bench/throughput.py --model "$MODEL" --num-seqs 256 2>&1 | tee -a "$out/offline.log" \
               | grep -E "^throughput|Error" ;;
    inf|rates|single)
      [ -n "${server:-}" ] || start_server || exit 1
      case $part in
        inf) for c in $CLIENTS 1; do echo "== rate inf, 256 requests, $c client processes"; cpu
               bench --num-requests 256 --num-clients "$c" --seed "$c" 2>&1 | tee -a "$out/serving.log"; cpu; done ;;
        rates) for r in 4 8 16; do echo "== rate $r, 256 requests"
                 bench --num-requests 256 --request-rate "$r" --num-clients 2 --seed "$((100 + r))" 2>&1 | tee -a "$out/serving.log"; done ;;
        single) echo "== one stream at a time: prompt 1024, output 256"
                bench --num-requests 6 --max-concurrency 1 --min-input-len 1024 --max-input-len 1024 \
                  --min-output-len 256 --max-output-len 256 2>&1 | tee -a "$out/serving.log" ;;
      esac ;;
    decode) python3 bench/decode_step.py 2>&1 | tee "$out/decode_step.log" | grep -vE "it/s|Capturing" ;;
  esac
done
[ -n "${server:-}" ] && { kill -TERM "$server"; wait "$server"; echo "server exit code $?"; }
grep -E "Engine ready|Serving" "$out/server.log" 2>/dev/null | head -3
