#!/usr/bin/env bash
# Live gateway benchmark: one Mooncake trace replayed by an open-loop client through
#   (a) kvroute gateway            (kvroute's own routing, KV events from every engine),
#   (b) smg launch --policy cache_aware   (PyPI smg, installed here into a venv),
#   (c) kvroute gateway, round robin,
# in front of the same 8 mock OpenAI engines (`kvroute fake-engine --openai`), in one run,
# alternating: odd rounds a b c, even rounds c b a, so a steady drift of the machine favours none.
#
#   bash bench/gateway.sh                  # ROUNDS=2 REQUESTS=600 SPEEDUP=16 TIME_SCALE=0.25
#   KVROUTE_BIN=/path/to/kvroute bash bench/gateway.sh   # a prebuilt binary, no cargo build
#
# Method
# - Engines: 8 mock engines (the simulator's engine model in real time: prefix cache with LRU,
#   chunked prefill, the fitted step time × TIME_SCALE), each publishing its KV events on its own
#   ZMQ port. Every run starts 8 fresh engines and a fresh server: the engines' prefix caches and
#   the routers' indexes would otherwise carry one run's work into the next.
# - Workload: REQUESTS rows of the trace from row SKIP; arrivals at the trace's timestamps / SPEEDUP
#   whatever the answers (open loop); prompts expanded from the 512-token hash ids as kvroute's
#   simulator does, cut at MAX_PROMPT_TOKENS; max_tokens = output_length capped at
#   MAX_OUTPUT_TOKENS; `stream: true` on /v1/completions. smg's /v1/completions takes only text
#   prompts (a token-id list is a 400), so every server gets the same text: one ASCII character
#   per trace token, which the engines' byte-level tokenizer turns back into one token each
#   (bench/gateway_client.py). kvroute's gateway tokenizes it with the equivalent tokenizer.json
#   (written by the client's byte-tokenizer mode); KVROUTE_PROMPT_FORMAT=tokens sends (a) and (c)
#   the same prompts as token ids instead (no tokenization in the gateway).
# - CPU: the server starts under taskset on the upper half of the allowed CPUs (so every thread
#   it starts stays there and its runtime sizes itself to them), engines and client on the lower
#   half; on 2 cores, one each. The server's CPU per request is its utime + stime (/proc/PID/stat, all threads)
#   over the run ÷ the requests sent, also per thread name. On a shared machine each run first
#   waits until the machine is idle, records the CPU other work took while it ran, and is run
#   again (up to BUSY_RETRIES times) when that passed BUSY_MAX_PCT %.
# - Measured by the client: TTFT (first content chunk), E2E, errors, throughput; after each
#   kvroute run, GET /loads must show no booking left (active requests, prefill tokens, decode
#   blocks all 0).
# - Gateway overhead (OVERHEAD=1, kvroute only): OVERHEAD_CONCURRENCY closed-loop streams, the
#   engines at OVERHEAD_TIME_SCALE, through the gateway, recording the engine each request went
#   to (x-kvroute-worker-id); then, on fresh engines, the same requests in the same order at the
#   same concurrency sent straight to those engines. The mock engine reports its own time to first
#   token (from its handler's start) in the usage chunk, so per request client TTFT − engine TTFT
#   is what sits between client and engine; its p50 through the gateway less its p50 straight to
#   the engines (the client and loopback alone) is the gateway's overhead, free of the engines'
#   step timing. Also reported: the difference of the two runs' TTFT p50s and the median
#   per-request difference. OVERHEAD_ROUNDS pairs, alternating which goes first; the figure is
#   the median over the pairs.
#
# Writes bench/results/gateway-<UTC start>.json and prints a markdown table; BENCHMARKS.md is
# updated between its gateway markers unless UPDATE_BENCHMARKS=0. Needs python3 (3.9+), PyPI
# access for the venv, and nothing but 127.0.0.1.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
cd "$repo"

ROUNDS="${ROUNDS:-2}"
ENGINES="${ENGINES:-8}"
TRACE="${TRACE:-$repo/../shared/traces/mooncake/conversation_trace.jsonl}"
SKIP="${SKIP:-0}"
REQUESTS="${REQUESTS:-600}"
# Arrivals SPEEDUP× denser than the trace, engines 1/TIME_SCALE× faster than the model: 16 and
# 0.25 load the 8 engines as the simulator's `--arrival-speedup 4` at engine speed 1 (its
# README's loaded fleet), in a quarter of the time.
SPEEDUP="${SPEEDUP:-16}"
TIME_SCALE="${TIME_SCALE:-0.25}"
# No request is sent after DURATION s of a run; its last answers get at most DRAIN s more.
DURATION="${DURATION:-60}"
DRAIN="${DRAIN:-60}"
MAX_PROMPT_TOKENS="${MAX_PROMPT_TOKENS:-16384}"
MAX_OUTPUT_TOKENS="${MAX_OUTPUT_TOKENS:-256}"
BLOCK_SIZE="${BLOCK_SIZE:-16}"
MODEL="${MODEL:-mock}"
KVROUTE_PROMPT_FORMAT="${KVROUTE_PROMPT_FORMAT:-text}"
# Extra flags for (a) and (c); and the flags that make (c) round robin. `kvroute gateway` has no
# round-robin policy yet: the flag below is the one assumed; (c) is skipped while
# `kvroute gateway --help` does not list it.
KVROUTE_GATEWAY_FLAGS="${KVROUTE_GATEWAY_FLAGS:-}"
KVROUTE_RR_FLAGS="${KVROUTE_RR_FLAGS:---gateway-policy round-robin}"
SMG_VERSION="${SMG_VERSION:-1.13.0}"
SMG_FLAGS="${SMG_FLAGS:-}"
OVERHEAD="${OVERHEAD:-1}"
# Pairs of overhead runs (gateway, direct), alternating: odd pairs gateway first, even direct.
OVERHEAD_ROUNDS="${OVERHEAD_ROUNDS:-4}"
OVERHEAD_CONCURRENCY="${OVERHEAD_CONCURRENCY:-100}"
OVERHEAD_REQUESTS="${OVERHEAD_REQUESTS:-3000}"
OVERHEAD_DURATION="${OVERHEAD_DURATION:-20}"
OVERHEAD_PROMPT_TOKENS="${OVERHEAD_PROMPT_TOKENS:-1024}"
OVERHEAD_OUTPUT_TOKENS="${OVERHEAD_OUTPUT_TOKENS:-64}"
# The overhead runs' engines stream at the modelled pace (1): 100 streams then carry ~140
# requests/s, as 100 real streams would, rather than the ~420/s of four-times-faster engines.
OVERHEAD_TIME_SCALE="${OVERHEAD_TIME_SCALE:-1}"
# Before each run, wait (at most QUIET_MAX_WAIT s) until other work takes at most QUIET_PCT % of
# the machine; each run records the share of the CPU other work took while it ran (`other work`).
QUIET_PCT="${QUIET_PCT:-10}"
QUIET_MAX_WAIT="${QUIET_MAX_WAIT:-120}"
# A run during which other work took more than BUSY_MAX_PCT % of the machine is run again, at
# most BUSY_RETRIES times (the last attempt counts whatever it met).
BUSY_MAX_PCT="${BUSY_MAX_PCT:-5}"
BUSY_RETRIES="${BUSY_RETRIES:-2}"
SERVER_PORT="${SERVER_PORT:-18390}"
SMG_METRICS_PORT="${SMG_METRICS_PORT:-18391}"
ENGINE_PORT_BASE="${ENGINE_PORT_BASE:-18400}"
EVENTS_PORT_BASE="${EVENTS_PORT_BASE:-18500}"
venv="${KVROUTE_BENCH_VENV:-$here/.venv-gateway}"
stamp="$(date -u +%Y-%m-%dT%H-%M-%SZ)"
workdir="$(mktemp -d)"
elapsed() { printf '[%d:%02d]' $((SECONDS / 60)) $((SECONDS % 60)); }
say() { echo "== $(elapsed) $*"; }

# CPUs: the lower half of the allowed ones for engines and client, the upper half for the server.
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

say "installing smg==$SMG_VERSION into $venv$([ -z "${KVROUTE_BIN:-}" ] && echo ', building kvroute (release)')"
(
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('smg') != '$SMG_VERSION')" 2>/dev/null; then
    "$venv/bin/pip" install -q "smg==$SMG_VERSION"
  fi
) &
pip_pid=$!
if [ -n "${KVROUTE_BIN:-}" ]; then
  kvroute="$KVROUTE_BIN"
else
  cargo build --release -q -p kvroute
  kvroute="${CARGO_TARGET_DIR:-$repo/target}/release/kvroute"
fi
if ! wait "$pip_pid"; then
  echo "installing smg==$SMG_VERSION failed" >&2
  exit 1
fi
smg="$venv/bin/smg"

has_gateway=0
"$kvroute" gateway --help >/dev/null 2>&1 && has_gateway=1
has_rr=0
rr_flag="${KVROUTE_RR_FLAGS%% *}"
if [ "$has_gateway" = 1 ] && [ -n "$rr_flag" ] && "$kvroute" gateway --help | grep -q -- "$rr_flag"; then
  has_rr=1
fi
if [ "$has_gateway" = 0 ]; then
  say "$kvroute has no gateway subcommand: only (b) smg runs"
elif [ "$has_rr" = 0 ]; then
  say "kvroute gateway has no $rr_flag: (c) round robin is skipped"
fi

python3 "$here/gateway_client.py" byte-tokenizer --out "$workdir/tokenizer.json"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$workdir"
}
trap cleanup EXIT

engine_pids=()
start_engines() {
  engine_pids=()
  local i
  for i in $(seq 0 $((ENGINES - 1))); do
    taskset -c "$client_cpus" "$kvroute" fake-engine --openai --port $((ENGINE_PORT_BASE + i)) \
      --model "$MODEL" --block-size "$BLOCK_SIZE" --bind "tcp://127.0.0.1:$((EVENTS_PORT_BASE + i))" \
      --time-scale "${engine_time_scale:-$TIME_SCALE}" --max-model-len $((MAX_PROMPT_TOKENS + MAX_OUTPUT_TOKENS)) \
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
# Ends a process and waits for it: SIGTERM, SIGKILL after 10 s.
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
start_server() { # name
  local name=$1 args=() i
  case "$name" in
    kvroute | kvroute-rr)
      for i in $(seq 0 $((ENGINES - 1))); do
        args+=(--worker "${engine_urls[$i]}=tcp://127.0.0.1:$((EVENTS_PORT_BASE + i))")
      done
      if [ "$KVROUTE_PROMPT_FORMAT" = text ]; then
        args+=(--tokenizer "$MODEL=$workdir/tokenizer.json")
      fi
      # shellcheck disable=SC2206 # word splitting of the flag strings is wanted
      if [ "$name" = kvroute-rr ]; then args+=($KVROUTE_RR_FLAGS); fi
      # shellcheck disable=SC2206
      args+=($KVROUTE_GATEWAY_FLAGS)
      taskset -c "$server_cpus" "$kvroute" gateway --port "$SERVER_PORT" --model "$MODEL" \
        --block-size "$BLOCK_SIZE" "${args[@]}" >"$workdir/$name-server.log" 2>&1 &
      ;;
    smg)
      # shellcheck disable=SC2206
      taskset -c "$server_cpus" "$smg" launch --host 127.0.0.1 --port "$SERVER_PORT" \
        --worker-urls "${engine_urls[@]}" --policy cache_aware \
        --prometheus-host 127.0.0.1 --prometheus-port "$SMG_METRICS_PORT" --log-level warn \
        $SMG_FLAGS >"$workdir/$name-server.log" 2>&1 &
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
    echo "$name did not list $ENGINES ready workers within 60 s:" >&2
    tail -20 "$workdir/$name-server.log" >&2
    exit 1
  fi
  # The KV-event subscriptions connect in the background: a moment for them, for every server.
  sleep 1
}

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# Each thread's name and CPU ticks (utime + stime), one JSON object {tid: [name, ticks]}.
threads_snapshot() {
  python3 - "$1" <<'PY'
import json, os, sys
out = {}
task = f"/proc/{sys.argv[1]}/task"
for tid in os.listdir(task):
    try:
        stat = open(f"{task}/{tid}/stat").read()
    except OSError:
        continue
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    out[tid] = [name, int(fields[11]) + int(fields[12])]
print(json.dumps(out))
PY
}
engines_ticks() { local p t=0; for p in "${engine_pids[@]}"; do t=$((t + $(cpu_ticks "$p"))); done; echo "$t"; }

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

# On a shared machine: before each run, wait until the machine has been idle (below QUIET_PCT %
# busy over a second) for QUIET_MAX_WAIT s at most; the run records how busy it still was.
wait_quiet() {
  python3 - "$QUIET_PCT" "$QUIET_MAX_WAIT" <<'PY'
import sys, time
limit, max_wait = float(sys.argv[1]), float(sys.argv[2])
def busy():
    def read():
        f = open("/proc/stat").readline().split()[1:9]
        return list(map(int, f))
    a = read(); time.sleep(1); b = read()
    d = [y - x for x, y in zip(a, b)]
    return 100 * (d[0] + d[1] + d[2]) / (sum(d) or 1)
start = time.time()
while True:
    pct = busy()
    if pct <= limit or time.time() - start >= max_wait:
        break
if pct > limit:
    print(f"   machine still {pct:.0f} % busy after {max_wait:.0f} s: running anyway", file=sys.stderr)
PY
}

# One measured run, again while other work took more than BUSY_MAX_PCT % of the machine.
run() { # name label mode [client flags...]
  local attempt other
  for attempt in $(seq 0 "$BUSY_RETRIES"); do
    run_once "$@"
    other=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); r['attempts']=$attempt+1; json.dump(r,open(sys.argv[1],'w')); print(round(r['other_cpu_pct']))" "$workdir/$2.json")
    if [ "$other" -le "$BUSY_MAX_PCT" ]; then break; fi
    if [ "$attempt" -lt "$BUSY_RETRIES" ]; then echo "   other work took $other % of the machine: $2 again"; fi
  done
}

# One measured run: fresh engines, fresh server, the client, the server's CPU, then teardown.
run_once() { # name label mode [client flags...]
  local name=$1 label=$2 mode=$3
  shift 3
  wait_quiet
  start_engines
  local url=$server_url format=text
  case "$name" in
    direct) url=${engine_urls[0]} ;;
    *) start_server "$name" ;;
  esac
  case "$name" in kvroute | kvroute-rr | direct) format=$KVROUTE_PROMPT_FORMAT ;; esac
  local cpu0=0 cpu1=0 engines0 engines1 left=null
  echo '{}' >"$workdir/threads0"
  echo '{}' >"$workdir/threads1"
  if [ -n "$server_pid" ]; then
    cpu0=$(cpu_ticks "$server_pid")
    threads_snapshot "$server_pid" >"$workdir/threads0"
  fi
  engines0=$(engines_ticks)
  grep '^cpu' /proc/stat >"$workdir/stat0"
  taskset -c "$client_cpus" python3 "$here/gateway_client.py" "$mode" --url "$url" \
    --trace "$TRACE" --skip "$SKIP" --model "$MODEL" --prompt-format "$format" \
    --drain-secs "$DRAIN" --label "$label" --out "$workdir/$label.json" "$@"
  if [ -n "$server_pid" ]; then
    cpu1=$(cpu_ticks "$server_pid")
    threads_snapshot "$server_pid" >"$workdir/threads1"
  fi
  engines1=$(engines_ticks)
  grep '^cpu' /proc/stat >"$workdir/stat1"
  if [ "$name" = kvroute ] || [ "$name" = kvroute-rr ]; then
    sleep 0.5
    left=$(bookings_left || echo null)
  fi
  python3 - "$workdir/$label.json" "$name" "$cpu0" "$cpu1" "$workdir/stat0" "$workdir/stat1" "$left" \
    "$client_cpus" "$server_cpus" "$engines0" "$engines1" "$workdir/threads0" "$workdir/threads1" <<'PY'
import json, os, sys
path, name, cpu0, cpu1, stat0, stat1, left, client_cpus, server_cpus, e0, e1, th0, th1 = sys.argv[1:]
r = json.load(open(path))
r["server"] = name
tick = os.sysconf("SC_CLK_TCK")
if name != "direct":
    r["server_cpu_s"] = (float(cpu1) - float(cpu0)) / tick
    r["server_cpu_per_request_ms"] = 1000 * r["server_cpu_s"] / max(1, r["requests"])
    # Per thread name (threads that ended during the run are missing): where the CPU went.
    t0, t1 = json.load(open(th0)), json.load(open(th1))
    by_name = {}
    for tid, (thread, ticks) in t1.items():
        used = ticks - (t0.get(tid, [thread, 0])[1])
        by_name[thread] = by_name.get(thread, 0) + used
    r["server_cpu_per_request_ms_by_thread"] = {
        k: round(1000 * v / tick / max(1, r["requests"]), 3)
        for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]) if v > 0
    }
def counters(path):  # "cpu" or "cpuN" -> user nice system idle iowait irq softirq steal
    return {l.split()[0]: list(map(int, l.split()[1:9])) for l in open(path)}
c0, c1 = counters(stat0), counters(stat1)
def busy_pct(cpus):  # the CPUs' mean busy share over the replay (measured by the client)
    values = [r["cpu_busy_pct"].get(c) for c in cpus.split(",")]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None
d = [b - a for a, b in zip(c0["cpu"], c1["cpu"])]
r["machine_steal_pct"] = 100 * d[7] / (sum(d) or 1)
r["client_cpus_busy_pct"] = busy_pct(client_cpus)
r["server_cpus_busy_pct"] = busy_pct(server_cpus)
r["engines_cpu_s"] = (float(e1) - float(e0)) / tick
# CPU taken by anything but the server, the engines and the client (other work on a shared
# machine), as a share of the machine's CPU time over the run.
busy_s = (d[0] + d[1] + d[2]) / tick  # user, nice, system (interrupts are nobody's)
r["machine_softirq_pct"] = 100 * (d[5] + d[6]) / (sum(d) or 1)
ours = r.get("server_cpu_s", 0) + r["engines_cpu_s"] + r["client_process_cpu_s"]
r["other_cpu_pct"] = max(0.0, 100 * (busy_s - ours) / ((sum(d) / tick) or 1))
r["bookings_left"] = None if left == "null" else float(left)
json.dump(r, open(path, "w"))
PY
  if [ -n "$server_pid" ]; then stop "$server_pid"; fi
  server_pid=
  stop "${engine_pids[@]}"
}

servers=()
if [ "$has_gateway" = 1 ]; then servers+=(kvroute); fi
servers+=(smg)
if [ "$has_rr" = 1 ]; then servers+=(kvroute-rr); fi
say "$ROUNDS rounds of ${servers[*]}: $REQUESTS requests from row $SKIP, arrivals ×$SPEEDUP, engines at time scale $TIME_SCALE; server on CPU $server_cpus, engines and client on CPU $client_cpus"
for round in $(seq 1 "$ROUNDS"); do
  order=("${servers[@]}")
  if [ $((round % 2)) = 0 ]; then
    order=()
    for ((i = ${#servers[@]} - 1; i >= 0; i--)); do order+=("${servers[$i]}"); done
  fi
  for name in "${order[@]}"; do
    run "$name" "$name-r$round" trace --requests "$REQUESTS" --speedup "$SPEEDUP" \
      --duration-secs "$DURATION" --max-prompt-tokens "$MAX_PROMPT_TOKENS" \
      --max-output-tokens "$MAX_OUTPUT_TOKENS"
    echo "   $(elapsed) $name round $round done"
  done
done

if [ "$OVERHEAD" = 1 ] && [ "$has_gateway" = 1 ]; then
  say "gateway overhead: $OVERHEAD_CONCURRENCY streams through kvroute, then the same requests straight to the engines (time scale $OVERHEAD_TIME_SCALE)"
  engine_time_scale=$OVERHEAD_TIME_SCALE
  overhead_flags=(--concurrency "$OVERHEAD_CONCURRENCY" --requests "$OVERHEAD_REQUESTS"
    --duration-secs "$OVERHEAD_DURATION" --max-prompt-tokens "$OVERHEAD_PROMPT_TOKENS"
    --max-output-tokens "$OVERHEAD_OUTPUT_TOKENS" --per-request --engine-ttft)
  # Every direct run replays the engines the first gateway run chose.
  routes="$workdir/overhead-gateway-1.json"
  for k in $(seq 1 "$OVERHEAD_ROUNDS"); do
    if [ $((k % 2)) = 1 ]; then
      run kvroute "overhead-gateway-$k" concurrency "${overhead_flags[@]}" --record-routes
      run direct "overhead-direct-$k" concurrency "${overhead_flags[@]}" --replay-routes "$routes"
    else
      run direct "overhead-direct-$k" concurrency "${overhead_flags[@]}" --replay-routes "$routes"
      run kvroute "overhead-gateway-$k" concurrency "${overhead_flags[@]}" --record-routes
    fi
  done
fi

out="$here/results/gateway-$stamp.json"
commit=$(git -C "$repo" rev-parse --short=7 HEAD 2>/dev/null || echo unknown)
git -C "$repo" diff --quiet HEAD -- crates Cargo.toml Cargo.lock 2>/dev/null || commit="$commit-dirty"
kv_version=$("$kvroute" --version 2>/dev/null || echo unknown)
# How the results name the kvroute binary (KVROUTE_BIN_LABEL, e.g. the branch and commit it was
# built from when KVROUTE_BIN is not this checkout's build).
kv_label="${KVROUTE_BIN_LABEL:-$kv_version, built from $commit}"
python3 "$here/gateway_summary.py" --dir "$workdir" --out "$out" \
  --machine "$(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -m)" \
  --cpu-model "$(awk -F': *' '/^model name/ {print $2; exit}' /proc/cpuinfo)" \
  --commit "$commit" --kvroute-bin "$kv_label" --smg-version "$SMG_VERSION" \
  --config "engines=$ENGINES time_scale=$TIME_SCALE overhead_time_scale=$OVERHEAD_TIME_SCALE speedup=$SPEEDUP requests=$REQUESTS skip=$SKIP max_prompt_tokens=$MAX_PROMPT_TOKENS max_output_tokens=$MAX_OUTPUT_TOKENS block_size=$BLOCK_SIZE kvroute_prompt_format=$KVROUTE_PROMPT_FORMAT server_cpus=$server_cpus client_cpus=$client_cpus trace=$(basename "$TRACE")" \
  $([ "${UPDATE_BENCHMARKS:-1}" = 1 ] && echo --benchmarks "$repo/BENCHMARKS.md")
say "wrote $out"
