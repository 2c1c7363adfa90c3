#!/usr/bin/env bash
# Side-by-side benchmark: kvroute vs NVIDIA Dynamo's selection service (PyPI ai-dynamo-runtime),
# same machine, same workload, same run, alternating A B B A.
#
#   bench/side_by_side.sh   # ROUNDS=3 DURATION=12 WARMUP=8 STORM_DURATION=10 WORKERS=64 CONCURRENCY=32
#   INGEST_FREE=1 bench/side_by_side.sh   # also a cycle run per server without KV-event ingest
#   ISOLATED=0 bench/side_by_side.sh      # without the cycle rounds on separate cores
#   FLEET_ONLY=1 bench/side_by_side.sh    # only the fleet phase ("Select by W", below)
#   FLEET_EVENT_WORKERS=1000 ...          # workers given a KV-event endpoint there (1,800)
#   FLEET=0 bench/side_by_side.sh         # without it
#
# Dynamo's service binds 0.0.0.0 with no option to change it, so both servers and the load
# generator run inside a network namespace whose only interface is loopback (needs root). The
# script installs its own Python dependencies into bench/.venv, writes bench/results/<date>.json,
# prints a markdown table and regenerates BENCHMARKS.md's headline and history from
# bench/results/*.json (summarize.py --history; UPDATE_BENCHMARKS=0 leaves BENCHMARKS.md alone).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
cd "$repo"

# Three rounds, so that the median is that of three ratios and one round run while the machine
# was slow (steal, see the table) does not move it; 12 s runs keep the whole script under 10 min
# on a fresh machine (3 rounds of 15 s took 10 min 22 s there with a third of the CPU stolen).
ROUNDS="${ROUNDS:-3}"
DURATION="${DURATION:-12}"
WARMUP="${WARMUP:-8}"
# Cycle rounds with the load generator on cores of its own (below): 1 to run them, each
# ISO_DURATION seconds (10, so that the whole script stays under 10 min on a fresh machine).
ISOLATED="${ISOLATED:-1}"
ISO_DURATION="${ISO_DURATION:-10}"
# The event-storm runs (three pairs of quiet and storm runs, each pair adjacent in time).
STORM_DURATION="${STORM_DURATION:-10}"
WORKERS="${WORKERS:-64}"
CONCURRENCY="${CONCURRENCY:-32}"
MAX_PROMPT_TOKENS="${MAX_PROMPT_TOKENS:-16384}"
DYNAMO_VERSION="${DYNAMO_VERSION:-1.6.1}"
NS="${NS:-kvbench}"
# kvroute's router profile. dynamo (the default here): Dynamo's weights and no prediction on
# route, so both servers make the same decisions and the engines publish the same events, as in
# every run before kvroute's own profile existed; kvroute: the service's default, whose
# predict-on-route adds index work per booking (docs/perf-decisions.md).
KVROUTE_PROFILE="${KVROUTE_PROFILE:-dynamo}"
# Niceness of the fake engines' thread in the load generator: 19 stands in for engines on other
# hosts (their publishing uses only CPU the servers and clients leave); 0 makes them compete.
ENGINE_NICE="${ENGINE_NICE:-19}"
# The fleet phase: registration, /select and the cycle at each of FLEET_WORKERS registered
# workers (one partition), isolated (the load generator on cores of its own) and shared, each
# run FLEET_DURATION seconds; then both services in process from Python (bench/inprocess.py).
# 5 s runs keep the phase near 5 min on 2 cores, the whole script near 15.
FLEET="${FLEET:-1}"
FLEET_ONLY="${FLEET_ONLY:-0}"
FLEET_WORKERS="${FLEET_WORKERS:-64 1000 4000}"
# Only workers 1..=FLEET_EVENT_WORKERS get a KV-event endpoint (and a fake engine); the others
# are registered without one, with the same bodies on both servers. Dynamo lists those as
# incomplete (not schedulable), kvroute schedules them on load alone: at 4,000 kvroute picks
# among 4,000 workers and Dynamo among 1,800 (the summary prints each server's lifecycles).
# Dynamo 1.6.1 holds ten file descriptors per schedulable rank (a ZMQ context each, measured
# with `ls /proc/PID/fd`: the same whether the endpoint is the worker's own, shared with other
# workers, ipc:// or has no listener; a worker without one is not schedulable), so it aborts
# near 2,000 under this machine's 20,000-file limit; 1,800 leaves it ~1,900 spare.
FLEET_EVENT_WORKERS="${FLEET_EVENT_WORKERS:-1800}"
FLEET_DURATION="${FLEET_DURATION:-5}"
INPROCESS_SECONDS="${INPROCESS_SECONDS:-3}"
# Fleet engines' ports: base + worker id, up to 4,000 each, clear of the bases below and of
# Linux's ephemeral range (from 32768), where the servers' thousands of outgoing KV-event
# connections take their local ports.
FLEET_DYN_EVENTS_BASE=20000
FLEET_KV_EVENTS_BASE=24000
INPROCESS_EVENTS_BASE=28000
DYN_PORT=18081
KV_PORT=18082
# Each server subscribes only to its own fake engines: otherwise the idle server would ingest the
# measured one's KV events and take CPU from it.
DYN_EVENTS_BASE=30000
KV_EVENTS_BASE=31000
# The load-generator-alone storm's engines: nobody subscribes to these.
UNSUBSCRIBED_EVENTS_BASE=32000
TRACE="${TRACE:-$repo/../shared/traces/mooncake/conversation_trace.jsonl}"
venv="$here/.venv"
stamp="$(date -u +%Y-%m-%dT%H-%M-%SZ)"
workdir="$(mktemp -d)"
# Each phase's heading and each run's line start with the time since the script started.
elapsed() { printf '[%d:%02d]' $((SECONDS / 60)) $((SECONDS % 60)); }
say() { echo "== $(elapsed) $*"; }

say "building kvroute (release) and installing ai-dynamo-runtime==$DYNAMO_VERSION into $venv"
# The install runs while cargo builds.
(
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q "ai-dynamo-runtime==$DYNAMO_VERSION"
) &
pip_pid=$!
# Without replica sync (the `nats` feature, not used here): half the build time on a fresh
# machine (2 min 45 s instead of 5 min 7 s on 2 cores).
cargo build --release -q -p kvroute --no-default-features
kvroute="$repo/target/release/kvroute"
[ -n "${CARGO_TARGET_DIR:-}" ] && kvroute="$CARGO_TARGET_DIR/release/kvroute"
if ! wait "$pip_pid"; then
  echo "installing ai-dynamo-runtime==$DYNAMO_VERSION failed" >&2
  exit 1
fi
if [ "$FLEET" = 1 ]; then
  # kvroute's Python binding next to Dynamo's, for the in-process comparison. Its own target
  # dir: maturin's PYO3 environment would otherwise rebuild the binary's dependencies.
  say "building the kvroute wheel (release) into $venv"
  "$venv/bin/pip" install -q maturin
  rm -rf "$workdir/wheels"
  CARGO_TARGET_DIR="$repo/target/py-release" "$venv/bin/maturin" build --release --locked -q \
    --manifest-path "$repo/crates/py/Cargo.toml" --out "$workdir/wheels"
  "$venv/bin/pip" install -q --force-reinstall --no-deps "$workdir"/wheels/kvroute-*.whl
fi

pids=()
created=0
cleanup() {
  # `ip netns exec` wrappers may not pass signals on: end every process in the namespace.
  for p in $(ip netns pids "$NS" 2>/dev/null) "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ "$created" = 1 ]; then ip netns del "$NS" 2>/dev/null || true; fi
  rm -rf "$workdir"
}
trap cleanup EXIT
if ! ip netns list | grep -qw "$NS"; then ip netns add "$NS"; created=1; fi
ip netns exec "$NS" ip link set lo up
in_ns() { ip netns exec "$NS" "$@"; }

in_ns "$venv/bin/python" -m dynamo.select_service --port "$DYN_PORT" >"$workdir/dynamo.log" 2>&1 &
pids+=($!)
in_ns "$kvroute" serve --port "$KV_PORT" --router-profile "$KVROUTE_PROFILE" >"$workdir/kvroute.log" 2>&1 &
pids+=($!)
for port in "$DYN_PORT" "$KV_PORT"; do
  for _ in $(seq 1 100); do
    if in_ns python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null; then break; fi
    sleep 0.2
  done
done

# The servers' own processes (each started through a subshell), for their CPU time.
DYN_PID=$(pgrep -n -f "dynamo.select_service --port $DYN_PORT")
KV_PID=$(pgrep -n -f "$kvroute serve --port $KV_PORT --router-profile")

# A process's user and system CPU time (all threads), in clock ticks, as "user,system".
cpu_ticks() { awk '{print $14 "," $15}' "/proc/$1/stat"; }

# Stored blocks kvroute applied so far (from its /metrics).
stored_applied() {
  in_ns python3 -c "
import urllib.request
t = urllib.request.urlopen('http://127.0.0.1:$KV_PORT/metrics', timeout=5).read().decode()
print(sum(float(l.split()[-1]) for l in t.splitlines()
          if l.startswith('kvroute_kv_events_total{') and 'type=\"stored\"' in l and 'status=\"applied\"' in l))"
}
# Polls kvroute's applied count every $1 s, at most $2 times, from $3 (the count read last), until
# it stands still; prints the last count and how many seconds it was still moving. Fails when it
# never stood still.
applied_settle() {
  local every=$1 polls=$2 last=$3 now moving=0 i
  for i in $(seq 1 "$polls"); do
    sleep "$every"
    now=$(stored_applied)
    if [ "$now" = "$last" ]; then
      echo "$now $moving"
      return 0
    fi
    last=$now
    moving=$(awk "BEGIN {print $i * $every}")
  done
  echo "$last $moving"
  return 1
}
trace_args=()
[ -f "$TRACE" ] && trace_args=(--trace "$TRACE")
run() { # name port mode round register [extra loadgen flags...]
  local name=$1 port=$2 mode=$3 round=$4 register=$5
  shift 5
  local skip=(--skip-register)
  [ "$register" = 1 ] && skip=()
  local events_base=$KV_EVENTS_BASE server_pid=$KV_PID
  [ "$name" = dynamo ] && events_base=$DYN_EVENTS_BASE server_pid=$DYN_PID
  # Engines on ports no server subscribes to (the workers stay registered with the usual ones).
  [ -n "${unsubscribed_events_base:-}" ] && events_base=$unsubscribed_events_base
  # The server's CPU time (all its threads) and the machine's counters around the run: CPU per
  # request does not depend on how fast the machine happened to be, and steal (time the
  # hypervisor gave to other guests) shows when it was slow.
  local cpu_before stat_before applied_before=0 applied_end=0 applied_settled=0 settle_s=0
  # kvroute's cycle runs: how many of the run's KV events were applied only after it ended (a
  # lagging index would make the run look cheaper than it was). Dynamo exposes no such count;
  # its /dump stood still from a second after such a run (BENCHMARKS.md, known limits).
  local track_lag=0
  [ "$name" = kvroute ] && [ "$mode" = cycle ] && track_lag=1
  [ "$track_lag" = 1 ] && applied_before=$(stored_applied)
  cpu_before=$(cpu_ticks "$server_pid")
  stat_before=$(head -1 /proc/stat)
  # Pinned to its own cores in the isolated rounds.
  local pin=()
  [ -n "${loadgen_cpus:-}" ] && pin=(taskset -c "$loadgen_cpus")
  in_ns "${pin[@]}" "$kvroute" loadgen --url "http://127.0.0.1:$port" --workers "$WORKERS" "${skip[@]}" \
    --events-base-port "$events_base" --engine-nice "${engine_nice:-$ENGINE_NICE}" --concurrency "$CONCURRENCY" --duration-secs "$DURATION" \
    --mode "$mode" --max-prompt-tokens "$MAX_PROMPT_TOKENS" "${trace_args[@]}" \
    --label "$name-$mode-r$round" --out "$workdir/$name-$mode-r$round.json" "$@" >/dev/null
  local cpu_after stat_after
  cpu_after=$(cpu_ticks "$server_pid")
  stat_after=$(head -1 /proc/stat)
  if [ "$track_lag" = 1 ]; then
    applied_end=$(stored_applied)
    # Until the count stands still for half a second (at most 30 s).
    read -r applied_settled settle_s < <(applied_settle 0.5 60 "$applied_end" || true)
  fi
  python3 - "$workdir/$name-$mode-r$round.json" "$cpu_before" "$cpu_after" \
    "$stat_before" "$stat_after" "$track_lag" "$applied_before" "$applied_end" "$applied_settled" \
    "$settle_s" <<'PY'
import json, os, sys
path, cpu0, cpu1, stat0, stat1, lag, a0, a1, a2, settle = sys.argv[1:]
tick = os.sysconf("SC_CLK_TCK")
r = json.load(open(path))
(u0, s0), (u1, s1) = [map(float, c.split(",")) for c in (cpu0, cpu1)]
r["server_cpu_s"] = (u1 - u0 + s1 - s0) / tick
r["server_user_s"] = (u1 - u0) / tick
r["server_system_s"] = (s1 - s0) / tick
t0, t1 = [list(map(int, s.split()[1:9])) for s in (stat0, stat1)]
d = [b - a for a, b in zip(t0, t1)]  # user nice system idle iowait irq softirq steal
total = sum(d) or 1
r["machine_steal_pct"] = 100 * d[7] / total
r["machine_idle_pct"] = 100 * (d[3] + d[4]) / total
if lag == "1":
    r["stored_applied_during_run"] = float(a1) - float(a0)
    r["stored_applied_after_run"] = float(a2) - float(a1)
    r["index_settle_s"] = float(settle)
json.dump(r, open(path, "w"))
PY
  echo "   $(elapsed) $name $mode round $round done"
}

allowed=$(awk '/^Cpus_allowed_list/ {print $2}' /proc/self/status)
read -r loadgen_half server_half < <(python3 - "$allowed" <<'PY'
import sys
cpus = []
for part in sys.argv[1].split(","):
    lo, _, hi = part.partition("-")
    cpus += range(int(lo), int(hi or lo) + 1)
half = len(cpus) // 2
print(",".join(map(str, cpus[:half])) or "-", ",".join(map(str, cpus[half:])))
PY
)
# Every thread of both servers (-a); threads they start later inherit it.
# A server that died (see the fleet phase) is skipped.
pin_servers() {
  for pid in "$DYN_PID" "$KV_PID"; do
    [ -d "/proc/$pid" ] && taskset -a -p -c "$1" "$pid" >/dev/null
  done
  return 0
}

# Everything up to the fleet phase (FLEET_ONLY=1 skips it).
if [ "$FLEET_ONLY" != 1 ]; then
# Warm-up: a cycle run per server before the measured rounds, so that round 1, like every later
# round, meets servers whose indexes already hold what earlier engines published.
say "warming up: ${WARMUP}s of cycles per server"
for name in dynamo kvroute; do
  port=$KV_PORT; [ "$name" = dynamo ] && port=$DYN_PORT
  DURATION=$WARMUP run "$name" "$port" cycle warm 1
done

say "running $ROUNDS rounds of ${DURATION}s per server and mode (W=$WORKERS, C=$CONCURRENCY)"
# The machine's speed may drift during the run: odd rounds measure Dynamo first, even rounds
# kvroute first (A B B A), so a steady drift favours neither in the median.
for round in $(seq 1 "$ROUNDS"); do
  for mode in select cycle; do
    if [ $((round % 2)) = 1 ]; then
      run dynamo "$DYN_PORT" "$mode" "$round" 0
      run kvroute "$KV_PORT" "$mode" "$round" 0
    else
      run kvroute "$KV_PORT" "$mode" "$round" 0
      run dynamo "$DYN_PORT" "$mode" "$round" 0
    fi
  done
done

# The same cycle rounds with the load generator (clients and fake engines) on the lower half of
# the cores and both servers on the upper half, as when the clients and engines are other
# machines: in the rounds above the load generator takes ~75 µs of the same cores per cycle from
# whichever server is measured, which compresses the ratio of two CPU-bound servers towards 1.
# Each server gets the same cores here; on 2 cores, one each. The halves are of the CPUs this
# script may use (a container's cpuset need not start at 0).
if [ "$ISOLATED" = 1 ] && [ "$loadgen_half" != - ]; then
  say "$ROUNDS isolated cycle rounds of ${ISO_DURATION}s: servers on CPUs $server_half, load generator on CPUs $loadgen_half"
  pin_servers "$server_half"
  for round in $(seq 1 "$ROUNDS"); do
    if [ $((round % 2)) = 1 ]; then
      loadgen_cpus="$loadgen_half" DURATION=$ISO_DURATION run dynamo "$DYN_PORT" cycle "iso$round" 0
      loadgen_cpus="$loadgen_half" DURATION=$ISO_DURATION run kvroute "$KV_PORT" cycle "iso$round" 0
    else
      loadgen_cpus="$loadgen_half" DURATION=$ISO_DURATION run kvroute "$KV_PORT" cycle "iso$round" 0
      loadgen_cpus="$loadgen_half" DURATION=$ISO_DURATION run dynamo "$DYN_PORT" cycle "iso$round" 0
    fi
  done
  pin_servers "$allowed"
fi

# Optional (INGEST_FREE=1): one more cycle run per server whose fake engines publish to ports no
# server subscribes to, so that neither ingests KV events: how much of each server's cycle the
# ingest is (its index stays as the measured rounds left it; summarize.py prints the comparison).
# Not one of the side-by-side targets.
if [ "${INGEST_FREE:-0}" = 1 ]; then
  say "ingest-free cycle runs: the engines publish to ports no server subscribes to"
  for name in dynamo kvroute; do
    port=$KV_PORT; [ "$name" = dynamo ] && port=$DYN_PORT
    unsubscribed_events_base=$UNSUBSCRIBED_EVENTS_BASE \
      run "$name" "$port" cycle ingest-free 0 --subscriber-wait-secs 0
  done
fi

say "event storm: kvroute /select while every fake engine publishes as fast as it can"
storm_run() { # label [extra loadgen flags...]
  local label=$1
  shift
  local before after
  before=$(stored_applied)
  DURATION=$STORM_DURATION run kvroute "$KV_PORT" select "$label" 0 --event-storm "$@"
  after=$(stored_applied)
  python3 - "$workdir/kvroute-select-r$label.json" "$before" "$after" <<'PY'
import json, sys
path, before, after = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
r = json.load(open(path))
r["stored_blocks_applied_per_s"] = (after - before) / r["duration_s"]
json.dump(r, open(path, "w"))
PY
}
# A storm leaves seconds of queued events behind it (engine sockets, the apply queue): before
# each quiet run, wait until kvroute has applied them (its applied count stands still for 1 s).
drain() {
  applied_settle 1 60 "$(stored_applied)" >/dev/null || echo "   (kvroute still applying events after 60 s)"
}
# Each storm run is compared with the quiet run just before it.
drain
# First the load generator alone: the same storm published on ports kvroute does not subscribe
# to, so its p99 rise is what the storm costs outside the server (the floor of the next pair's).
# (No subscriber will come: the engines do not wait for one.)
unsubscribed_events_base=$UNSUBSCRIBED_EVENTS_BASE DURATION=$STORM_DURATION \
  run kvroute "$KV_PORT" select quiet-unsubscribed 0 --engine-idle --subscriber-wait-secs 0
unsubscribed_events_base=$UNSUBSCRIBED_EVENTS_BASE \
  storm_run storm-unsubscribed --engine-idle --subscriber-wait-secs 0
DURATION=$STORM_DURATION run kvroute "$KV_PORT" select quiet 0 --engine-idle
# Engines live on other hosts in production, where their publishing costs the router's machine
# nothing. At SCHED_IDLE the fake engines get a core only when the service and the clients leave
# one, and give it up as soon as one of theirs wakes. (At nice 19 they still took their whole
# slice once picked: the same storm published to no subscriber raised kvroute's p99 by
# 1.22–1.77× in alternating runs, against 1.12–1.43× at SCHED_IDLE; see docs/perf-decisions.md.)
storm_run storm --engine-idle
drain
DURATION=$STORM_DURATION run kvroute "$KV_PORT" select quiet-colocated 0
# The same storm with the publishers competing for this machine's two cores like any process.
engine_nice=0 storm_run storm-colocated
fi # FLEET_ONLY

# Select by W: the same servers with more and more workers registered (ids 1..=W, one
# partition; ids up to FLEET_EVENT_WORKERS with a fake engine each, the rest without a KV-event
# endpoint), so each point's index holds what the earlier ones published. Both servers get
# exactly the same registrations (fleet_register.py, same ids and bodies; the lifecycles each
# gave, and its open files, are in the summary). Per W: registration (latency and resident memory per worker added), then /select
# and the cycle with C connections, isolated first (the configuration the targets count), then
# shared, A B / B A by mode.
# A server that fails to register a point's workers (Dynamo 1.6.1 aborts near 2,000 workers
# with KV-event endpoints when its process may open 20,000 files: libzmq's "Too many open
# files") is recorded as failed at that W and left out from then on.
if [ "$FLEET" = 1 ]; then
  mkdir -p "$workdir/fleet"
  registered=0
  declare -A failed=()
  for W in $FLEET_WORKERS; do
    say "fleet W=$W: registering workers $((registered + 1))..$W on each server"
    for name in dynamo kvroute; do
      [ -n "${failed[$name]:-}" ] && continue
      port=$KV_PORT pid=$KV_PID base=$FLEET_KV_EVENTS_BASE log=$workdir/kvroute.log
      [ "$name" = dynamo ] && port=$DYN_PORT pid=$DYN_PID base=$FLEET_DYN_EVENTS_BASE log=$workdir/dynamo.log
      if ! in_ns python3 "$here/fleet_register.py" --port "$port" --from $((registered + 1)) --to "$W" \
        --events-base "$base" --event-workers "$FLEET_EVENT_WORKERS" --pid "$pid" --out "$workdir/fleet/$name-register-$W.json" 2>/dev/null; then
        failed[$name]=$W
        reason=$(grep -v "Selected worker" "$log" | tail -n 3 | cut -c1-300 | tr '\n' ' ')
        echo "   $name failed registering up to $W workers (alive: $([ -d "/proc/$pid" ] && echo yes || echo no)): $reason"
        python3 -c 'import json, sys; json.dump({"failed_at": int(sys.argv[1]), "alive": sys.argv[2] == "yes", "log": sys.argv[3]}, open(sys.argv[4], "w"))' \
          "$W" "$([ -d "/proc/$pid" ] && echo yes || echo no)" "$reason" "$workdir/fleet/$name-register-$W.json"
      fi
    done
    registered=$W
    for placement in iso shared; do
      cpus=""
      if [ "$placement" = iso ] && [ "$loadgen_half" != - ]; then
        pin_servers "$server_half"
        cpus=$loadgen_half
      else
        pin_servers "$allowed"
        if [ "$placement" = iso ]; then continue; fi
      fi
      say "fleet W=$W, $placement: /select and cycle runs of ${FLEET_DURATION}s per server"
      for mode in select cycle; do
        order="dynamo kvroute"
        [ "$mode" = cycle ] && order="kvroute dynamo"
        for name in $order; do
          [ -n "${failed[$name]:-}" ] && continue
          port=$KV_PORT; [ "$name" = dynamo ] && port=$DYN_PORT
          loadgen_cpus="$cpus" WORKERS=$W DURATION=$FLEET_DURATION \
            KV_EVENTS_BASE=$FLEET_KV_EVENTS_BASE DYN_EVENTS_BASE=$FLEET_DYN_EVENTS_BASE \
            run "$name" "$port" "$mode" "fleet-$placement-$W" 0 --event-workers "$FLEET_EVENT_WORKERS"
        done
      done
    done
  done
  pin_servers "$allowed"
  say "in process from Python: kvroute.SelectionService vs dynamo.llm.SelectionService"
  inprocess_trace=()
  [ -f "$TRACE" ] && inprocess_trace=(--trace "$TRACE")
  in_ns "$venv/bin/python" "$here/inprocess.py" --workers 64 --tokens 8192 \
    --seconds "$INPROCESS_SECONDS" --rounds 3 --events-base "$INPROCESS_EVENTS_BASE" \
    "${inprocess_trace[@]}" --out "$workdir/fleet/inprocess.json"
  fleet_out="$here/results/fleet-$stamp"
  python3 "$here/fleet_summary.py" --dir "$workdir" --workers "$FLEET_WORKERS" \
    --concurrency "$CONCURRENCY" --event-workers "$FLEET_EVENT_WORKERS" --out "$fleet_out"
  say "wrote $fleet_out.json and $fleet_out.md"
fi
[ "$FLEET_ONLY" = 1 ] && { say "done"; exit 0; }

out="$here/results/$stamp.json"
# The measured code: the commit, marked -dirty when the work tree's code differs from it.
commit=$(git -C "$repo" rev-parse --short=7 HEAD 2>/dev/null || echo unknown)
git -C "$repo" diff --quiet HEAD -- crates Cargo.toml Cargo.lock 2>/dev/null || commit="$commit-dirty"
python3 "$here/summarize.py" --dir "$workdir" --rounds "$ROUNDS" --out "$out" \
  --machine "$(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -m)" \
  --cpu-model "$(awk -F': *' '/^model name/ {print $2; exit}' /proc/cpuinfo)" --commit "$commit" \
  --dynamo-version "$DYNAMO_VERSION"
say "wrote $out"
if [ "${UPDATE_BENCHMARKS:-1}" = 1 ]; then
  python3 "$here/summarize.py" --history "$repo/BENCHMARKS.md" --results "$here/results"
fi
say "done"
