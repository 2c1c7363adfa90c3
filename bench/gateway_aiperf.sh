#!/usr/bin/env bash
# Live gateway benchmark with an unmodified third-party client: NVIDIA's `aiperf` (PyPI), through
#   kvroute        `kvroute gateway` (kvroute's own routing, KV events from every engine),
#   kvroute-rr     `kvroute gateway --gateway-policy round-robin`,
#   smg            `smg launch --policy cache_aware` (PyPI smg),
# each in front of 8 fresh mock OpenAI engines (`kvroute fake-engine --openai`), one after the
# other, on a few-hot-system-prompts workload: streaming chat, PREFIXES shared prefixes of
# PREFIX_TOKENS tokens (aiperf's prefix-prompt pool, one picked at random per request) before a
# USER_TOKENS-token user part of its own, OUTPUT_TOKENS output tokens, Poisson arrivals at RATE
# requests/s, REQUESTS requests.
#
#   bash bench/gateway_aiperf.sh                       # builds kvroute (release) first
#   KVROUTE_BIN=target/release/kvroute bash bench/gateway_aiperf.sh
#   FRONTS="kvroute smg" RATE=24 bash bench/gateway_aiperf.sh
#
# Method
# - Tokens: aiperf sizes its prompts with a Hugging Face tokenizer. The script writes one (one
#   token per character; bench/gateway_aiperf.py) as a hub cache entry, models--local--NAME/
#   snapshots/<hash>/ + refs/main, under a private HF_HOME, and runs aiperf with
#   HF_HUB_OFFLINE=1 and `--tokenizer local/NAME`: no download. The engines tokenize with the
#   same tokenizer.json, and kvroute's gateway with the same directory, whose chat template
#   renders a chat exactly as the engines do: the gateway's block hashes are the engines'.
#   smg routes on the request's text and needs no tokenizer.
# - Each front gets fresh engines (their prefix caches empty) and a fresh server; aiperf runs
#   once per front under `timeout RUN_TIMEOUT`, each request bounded by REQUEST_TIMEOUT; the same
#   --random-seed gives every front the same prompts and arrival times.
# - CPU: the server runs under taskset on the upper half of the allowed CPUs, engines and aiperf
#   on the lower half (on 2 cores, one each), as bench/gateway.sh does.
# - Measured by aiperf (its profile_export_aiperf.json): TTFT, inter-token latency, request
#   latency, requests completed and failed; output tokens counted from the engines' usage
#   (--use-server-token-count); prefix-cache hits = the engines' cached ÷ prompt tokens (their
#   usage). Beside it: each engine's CPU over the run (how evenly the front spread the work),
#   the server's CPU per request, and after a kvroute run its GET /loads (no booking may be
#   left) and its chosen overlap tokens (GET /metrics), which equal the engines' cached tokens
#   when the gateway's block hashes are theirs.
#
# Writes bench/results/gateway-aiperf-<UTC start>.json and .md (the table) and prints the table.
# Needs python3 (3.10+), PyPI access for the venv (or a venv already holding aiperf and smg:
# AIPERF_VENV), and nothing but 127.0.0.1.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
cd "$repo"

FRONTS="${FRONTS:-kvroute kvroute-rr smg}"
ENGINES="${ENGINES:-8}"
# Real seconds per modelled second of the engines (1: the modelled pace). 3 and 24 requests/s
# load the 8 engines moderately (a hit's prefill ~85 ms, a miss's ~300 ms, ~10 streams each)
# while aiperf, on one core with the engines, keeps up with the ~4,600 chunks/s.
TIME_SCALE="${TIME_SCALE:-3}"
# Engine KV pool in blocks (empty: the mock's default, which never evicts here).
KV_BLOCKS="${KV_BLOCKS:-}"
BLOCK_SIZE="${BLOCK_SIZE:-16}"
MODEL="${MODEL:-mock}"
REQUESTS="${REQUESTS:-400}"
RATE="${RATE:-24}"
PREFIXES="${PREFIXES:-3}"
PREFIX_TOKENS="${PREFIX_TOKENS:-4096}"
USER_TOKENS="${USER_TOKENS:-768}"
OUTPUT_TOKENS="${OUTPUT_TOKENS:-192}"
SEED="${SEED:-7}"
REQUEST_TIMEOUT="${REQUEST_TIMEOUT:-120}"
RUN_TIMEOUT="${RUN_TIMEOUT:-600}"
AIPERF_VERSION="${AIPERF_VERSION:-0.13.0}"
SMG_VERSION="${SMG_VERSION:-1.13.0}"
KVROUTE_GATEWAY_FLAGS="${KVROUTE_GATEWAY_FLAGS:-}"
SMG_FLAGS="${SMG_FLAGS:-}"
SERVER_PORT="${SERVER_PORT:-18390}"
SMG_METRICS_PORT="${SMG_METRICS_PORT:-18391}"
ENGINE_PORT_BASE="${ENGINE_PORT_BASE:-18400}"
EVENTS_PORT_BASE="${EVENTS_PORT_BASE:-18500}"
TOKENIZER_NAME="${TOKENIZER_NAME:-charchat}"
venv="${AIPERF_VENV:-$here/.venv-aiperf}"
stamp="$(date -u +%Y-%m-%dT%H-%M-%SZ)"
workdir="$(mktemp -d)"
# shellcheck source=bench/aiperf_common.sh
. "$here/aiperf_common.sh"
split_cpus

say "venv $venv: aiperf==$AIPERF_VERSION smg==$SMG_VERSION$([ -z "${KVROUTE_BIN:-}" ] && echo '; building kvroute (release)')"
ensure_venv "$venv" "aiperf==$AIPERF_VERSION" "smg==$SMG_VERSION" &
pip_pid=$!
build_kvroute
if ! wait "$pip_pid"; then
  echo "installing aiperf==$AIPERF_VERSION smg==$SMG_VERSION into $venv failed" >&2
  exit 1
fi
aiperf="$venv/bin/aiperf"
smg="$venv/bin/smg"
setup_tokenizer "$venv" "$TOKENIZER_NAME"

if ! "$kvroute" gateway --help | grep -q -- --gateway-policy; then
  echo "$kvroute gateway has no --gateway-policy" >&2
  exit 1
fi

engine_pids=()
start_engines() {
  engine_pids=()
  local i extra=()
  if [ -n "$KV_BLOCKS" ]; then extra+=(--kv-blocks "$KV_BLOCKS"); fi
  for i in $(seq 0 $((ENGINES - 1))); do
    taskset -c "$client_cpus" "$kvroute" fake-engine --openai --port $((ENGINE_PORT_BASE + i)) \
      --model "$MODEL" --block-size "$BLOCK_SIZE" --bind "tcp://127.0.0.1:$((EVENTS_PORT_BASE + i))" \
      --tokenizer "$snapshot/tokenizer.json" --time-scale "$TIME_SCALE" "${extra[@]}" \
      >"$workdir/engine-$i.log" 2>&1 &
    engine_pids+=($!)
    pids+=($!)
  done
  for i in $(seq 0 $((ENGINES - 1))); do wait_log "$workdir/engine-$i.log" "serving model"; done
}

engine_urls=()
for i in $(seq 0 $((ENGINES - 1))); do engine_urls+=("http://127.0.0.1:$((ENGINE_PORT_BASE + i))"); done
server_url="http://127.0.0.1:$SERVER_PORT"

server_pid=
start_server() { # front
  local front=$1 args=() i
  case "$front" in
    kvroute | kvroute-rr)
      for i in $(seq 0 $((ENGINES - 1))); do
        args+=(--worker "${engine_urls[$i]}=tcp://127.0.0.1:$((EVENTS_PORT_BASE + i))")
      done
      if [ "$front" = kvroute-rr ]; then args+=(--gateway-policy round-robin); fi
      # shellcheck disable=SC2206 # word splitting of the flag string is wanted
      args+=($KVROUTE_GATEWAY_FLAGS)
      taskset -c "$server_cpus" "$kvroute" gateway --bind 127.0.0.1 --port "$SERVER_PORT" \
        --model "$MODEL" --block-size "$BLOCK_SIZE" --tokenizer "$MODEL=$snapshot" "${args[@]}" \
        >"$workdir/$front-server.log" 2>&1 &
      ;;
    smg)
      # shellcheck disable=SC2206
      taskset -c "$server_cpus" "$smg" launch --host 127.0.0.1 --port "$SERVER_PORT" \
        --worker-urls "${engine_urls[@]}" --policy cache_aware \
        --prometheus-host 127.0.0.1 --prometheus-port "$SMG_METRICS_PORT" --log-level warn \
        $SMG_FLAGS >"$workdir/$front-server.log" 2>&1 &
      ;;
    *)
      echo "unknown front $front (kvroute, kvroute-rr, smg)" >&2
      exit 2
      ;;
  esac
  server_pid=$!
  pids+=($server_pid)
  # Ready when GET /workers lists every engine as registered (and, for smg, healthy).
  wait_workers "$server_url" "$ENGINES" "$front" "$workdir/$front-server.log"
  # The KV-event subscriptions connect in the background: a moment for them.
  sleep 1
}

# Each engine's CPU ticks, comma-separated: how the work spread over the engines.
engine_ticks() {
  local p out=()
  for p in "${engine_pids[@]}"; do out+=("$(cpu_ticks "$p")"); done
  (IFS=,; echo "${out[*]}")
}

runs=()
say "fronts: $FRONTS; $ENGINES engines at time scale $TIME_SCALE; $REQUESTS requests at $RATE/s (Poisson), $PREFIXES prefixes × $PREFIX_TOKENS + $USER_TOKENS user tokens, $OUTPUT_TOKENS out; server on CPU $server_cpus, engines and aiperf on CPU $client_cpus"
for front in $FRONTS; do
  start_engines
  start_server "$front"
  out="$workdir/aiperf-$front"
  cpu0=$(cpu_ticks "$server_pid")
  engines0=$(engine_ticks)
  rc=0
  run_aiperf "$out" "$workdir/aiperf-$front.log" "$server_url" || rc=$?
  cpu1=$(cpu_ticks "$server_pid")
  engines1=$(engine_ticks)
  left=null
  overlap='{}'
  if [ "$front" != smg ]; then
    sleep 0.5
    left=$(bookings_left "$server_url" || echo null)
    overlap=$(overlap_tokens "$server_url" || echo '{}')
  fi
  python3 - "$out" "$rc" "$cpu0" "$cpu1" "$left" "$REQUESTS" "$overlap" "$engines0" "$engines1" <<'PY'
import json, os, sys
out, rc, c0, c1, left, n, overlap, e0, e1 = sys.argv[1:]
os.makedirs(out, exist_ok=True)
tick = os.sysconf("SC_CLK_TCK")
cpu_s = (float(c1) - float(c0)) / tick
engines = [(int(b) - int(a)) / tick for a, b in zip(e0.split(","), e1.split(","))]
total = sum(engines) or 1
json.dump({"aiperf_exit_code": int(rc), "server_cpu_s": cpu_s,
           "server_cpu_per_request_ms": 1000 * cpu_s / max(1, int(n)),
           "bookings_left": None if left == "null" else float(left),
           "kvroute_selection_overlap_tokens": json.loads(overlap),
           "engine_cpu_s": engines,
           # The busiest engine's share of the engines' CPU (1/ENGINES when even).
           "busiest_engine_cpu_share": max(engines) / total if engines else None},
          open(f"{out}/server.json", "w"))
PY
  if [ "$rc" != 0 ]; then
    echo "   aiperf exited $rc against $front; its log's end:" >&2
    tail -30 "$workdir/aiperf-$front.log" >&2
  fi
  stop "$server_pid"
  server_pid=
  stop "${engine_pids[@]}"
  runs+=(--run "$front=$out")
  say "$front done (aiperf exit $rc, bookings left $left)"
done

mkdir -p "$here/results"
base="$here/results/gateway-aiperf-$stamp"
commit=$(commit_id)
python3 "$here/gateway_aiperf.py" summarize "${runs[@]}" --out-json "$base.json" --out-md "$base.md" \
  --meta "started=$stamp" --meta "commit=$commit" \
  --meta "kvroute=$("$kvroute" --version 2>/dev/null || echo unknown)" \
  --meta "aiperf=$AIPERF_VERSION" --meta "smg=$SMG_VERSION" \
  --meta "machine=$(machine)" \
  --meta "config=engines=$ENGINES time_scale=$TIME_SCALE kv_blocks=${KV_BLOCKS:-default} block_size=$BLOCK_SIZE requests=$REQUESTS rate=$RATE prefixes=$PREFIXES prefix_tokens=$PREFIX_TOKENS user_tokens=$USER_TOKENS output_tokens=$OUTPUT_TOKENS seed=$SEED server_cpus=$server_cpus client_cpus=$client_cpus" \
  --meta "kvroute_gateway_flags=$KVROUTE_GATEWAY_FLAGS" --meta "smg_flags=$SMG_FLAGS"
say "wrote $base.json and $base.md"
