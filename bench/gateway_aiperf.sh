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
elapsed() { printf '[%d:%02d]' $((SECONDS / 60)) $((SECONDS % 60)); }
say() { echo "== $(elapsed) $*"; }

pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
  done
  wait 2>/dev/null || true
  rm -rf "$workdir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

allowed=$(awk '/^Cpus_allowed_list/ {print $2}' /proc/self/status)
read -r client_cpus server_cpus < <(python3 - "$allowed" <<'PY'
import sys
cpus = []
for part in sys.argv[1].split(","):
    lo, _, hi = part.partition("-")
    cpus += range(int(lo), int(hi or lo) + 1)
half = max(1, len(cpus) // 2)
print(",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:] or cpus)))
PY
)

say "venv $venv: aiperf==$AIPERF_VERSION smg==$SMG_VERSION$([ -z "${KVROUTE_BIN:-}" ] && echo '; building kvroute (release)')"
(
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  if ! "$venv/bin/python" - "$AIPERF_VERSION" "$SMG_VERSION" 2>/dev/null <<'PY'; then
import importlib.metadata as m, sys
sys.exit(m.version("aiperf") != sys.argv[1] or m.version("smg") != sys.argv[2])
PY
    "$venv/bin/pip" install -q "aiperf==$AIPERF_VERSION" "smg==$SMG_VERSION"
  fi
) &
pip_pid=$!
if [ -n "${KVROUTE_BIN:-}" ]; then
  kvroute="$KVROUTE_BIN"
else
  nice -n 10 cargo build --release -q -p kvroute
  kvroute="${CARGO_TARGET_DIR:-$repo/target}/release/kvroute"
fi
if ! wait "$pip_pid"; then
  echo "installing aiperf==$AIPERF_VERSION smg==$SMG_VERSION into $venv failed" >&2
  exit 1
fi
aiperf="$venv/bin/aiperf"
smg="$venv/bin/smg"

# The tokenizer, in the hub cache layout, under a private HF_HOME; nothing may be downloaded.
export HF_HOME="$workdir/hf"
export HF_HUB_CACHE="$HF_HOME/hub"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
snapshot=$(python3 "$here/gateway_aiperf.py" tokenizer --hub-cache "$HF_HUB_CACHE" --name "$TOKENIZER_NAME")
"$venv/bin/python" - "local/$TOKENIZER_NAME" <<'PY'
import sys
from transformers import AutoTokenizer
t = AutoTokenizer.from_pretrained(sys.argv[1])
assert len(t.encode("a\nb", add_special_tokens=False)) == 3, "one token per character"
PY

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
  for i in $(seq 0 $((ENGINES - 1))); do
    for _ in $(seq 1 100); do
      grep -q "serving model" "$workdir/engine-$i.log" 2>/dev/null && break
      sleep 0.1
    done
    grep -q "serving model" "$workdir/engine-$i.log" || { cat "$workdir/engine-$i.log" >&2; exit 1; }
  done
}
# Ends processes and waits for them: SIGTERM, SIGKILL after 10 s.
stop() {
  local p
  for p in "$@"; do kill "$p" 2>/dev/null || true; done
  for p in "$@"; do
    for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
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
  if ! python3 - "$server_url" "$ENGINES" <<'PY'; then
import json, sys, time, urllib.request
url, want = sys.argv[1], int(sys.argv[2])
deadline = time.time() + 60
while time.time() < deadline:
    try:
        with urllib.request.urlopen(url + "/workers", timeout=2) as r:
            body = json.loads(r.read())
        items = body.get("workers", []) if isinstance(body, dict) else body
        ready = [w for w in items if w.get("is_healthy", True) and w.get("status", "ready") == "ready"]
        if len(ready) >= want:
            sys.exit(0)
    except (OSError, ValueError):
        pass
    time.sleep(0.2)
sys.exit(1)
PY
    echo "$front did not list $ENGINES ready workers within 60 s:" >&2
    tail -20 "$workdir/$front-server.log" >&2
    exit 1
  fi
  # The KV-event subscriptions connect in the background: a moment for them.
  sleep 1
}

# Bookings left on kvroute (GET /loads): the sum of every rank's counters, 0 when none is left.
bookings_left() {
  python3 - "$server_url" <<'PY'
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/loads", timeout=5) as r:
    parts = json.loads(r.read())
left = 0
for p in parts:
    left += p.get("pending_count", 0) or 0
    for rank in p.get("loads", []):
        for key in ("active_requests", "potential_prefill_tokens", "potential_decode_blocks"):
            left += rank.get(key, 0) or 0
print(left)
PY
}

# kvroute's own view (GET /metrics): the selections' device-overlap tokens, chosen and best,
# as {"chosen": N, "best": N}; {} when the gateway exports none.
overlap_tokens() {
  python3 - "$server_url" <<'PY'
import json, re, sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/metrics", timeout=5) as r:
    text = r.read().decode()
out = {}
for line in text.splitlines():
    m = re.match(r'kvroute_selection_overlap_tokens_total\{(.*)\} (\S+)', line)
    if m:
        kind = re.search(r'kind="(\w+)"', m.group(1))
        if kind:
            out[kind.group(1)] = out.get(kind.group(1), 0) + float(m.group(2))
print(json.dumps(out))
PY
}

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
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
  # --num-dataset-entries REQUESTS: every request its own user part (aiperf's default of 100
  # entries would repeat whole prompts).
  rc=0
  taskset -c "$client_cpus" timeout --kill-after=10 "$RUN_TIMEOUT" "$aiperf" profile \
    --model "$MODEL" --tokenizer "local/$TOKENIZER_NAME" --url "$server_url" \
    --endpoint-type chat --streaming --use-server-token-count \
    --num-prefix-prompts "$PREFIXES" --prefix-prompt-length "$PREFIX_TOKENS" \
    --isl "$USER_TOKENS" --isl-stddev 0 --osl "$OUTPUT_TOKENS" --osl-stddev 0 \
    --extra-inputs ignore_eos:true \
    --num-dataset-entries "$REQUESTS" --request-count "$REQUESTS" \
    --request-rate "$RATE" --arrival-pattern poisson --random-seed "$SEED" \
    --request-timeout-seconds "$REQUEST_TIMEOUT" \
    --no-server-metrics --no-gpu-telemetry --ui-type none \
    --artifact-dir "$out" >"$workdir/aiperf-$front.log" 2>&1 || rc=$?
  cpu1=$(cpu_ticks "$server_pid")
  engines1=$(engine_ticks)
  left=null
  overlap='{}'
  if [ "$front" != smg ]; then
    sleep 0.5
    left=$(bookings_left || echo null)
    overlap=$(overlap_tokens || echo '{}')
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
commit=$(git -C "$repo" rev-parse --short=7 HEAD 2>/dev/null || echo unknown)
git -C "$repo" diff --quiet HEAD -- crates Cargo.toml Cargo.lock 2>/dev/null || commit="$commit-dirty"
python3 "$here/gateway_aiperf.py" summarize "${runs[@]}" --out-json "$base.json" --out-md "$base.md" \
  --meta "started=$stamp" --meta "commit=$commit" \
  --meta "kvroute=$("$kvroute" --version 2>/dev/null || echo unknown)" \
  --meta "aiperf=$AIPERF_VERSION" --meta "smg=$SMG_VERSION" \
  --meta "machine=$(nproc) cores, $(awk -F': *' '/^model name/ {print $2; exit}' /proc/cpuinfo)" \
  --meta "config=engines=$ENGINES time_scale=$TIME_SCALE kv_blocks=${KV_BLOCKS:-default} block_size=$BLOCK_SIZE requests=$REQUESTS rate=$RATE prefixes=$PREFIXES prefix_tokens=$PREFIX_TOKENS user_tokens=$USER_TOKENS output_tokens=$OUTPUT_TOKENS seed=$SEED server_cpus=$server_cpus client_cpus=$client_cpus" \
  --meta "kvroute_gateway_flags=$KVROUTE_GATEWAY_FLAGS" --meta "smg_flags=$SMG_FLAGS"
say "wrote $base.json and $base.md"
