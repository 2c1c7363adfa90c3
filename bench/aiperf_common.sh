# Shared by bench/gateway_aiperf.sh and bench/pd_live.sh (sourced, not run): the aiperf
# venv, the kvroute build, the local tokenizer, CPU pinning, process bookkeeping and the
# kvroute inspections. The sourcing script sets `here` (bench/), `repo`, `workdir` (a temporary
# directory removed on exit) and `set -euo pipefail` first.

SECONDS=0
elapsed() { printf '[%d:%02d]' $((SECONDS / 60)) $((SECONDS % 60)); }
say() { echo "== $(elapsed) $*"; }

# Every process started, ended on exit.
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

# CPU: the server on the upper half of the allowed CPUs, engines and client on the lower half
# (on 2 cores, one each): sets client_cpus and server_cpus.
split_cpus() {
  local allowed
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
}

# ensure_venv VENV PACKAGE==VERSION...: creates VENV when missing and pip-installs the packages
# unless every one is installed at its version.
ensure_venv() {
  local venv=$1
  shift
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  if ! "$venv/bin/python" - "$@" 2>/dev/null <<'PY'; then
import importlib.metadata as m, sys
sys.exit(any(m.version(n) != v for n, _, v in (a.partition("==") for a in sys.argv[1:])))
PY
    "$venv/bin/pip" install -q "$@"
  fi
}

# Sets `kvroute`: KVROUTE_BIN, else a release build of this checkout.
build_kvroute() {
  if [ -n "${KVROUTE_BIN:-}" ]; then
    kvroute="$KVROUTE_BIN"
  else
    nice -n 10 cargo build --release -q -p kvroute
    kvroute="${CARGO_TARGET_DIR:-$repo/target}/release/kvroute"
  fi
}

# The tokenizer (bench/gateway_aiperf.py tokenizer), in the hub cache layout, under a private
# HF_HOME; nothing may be downloaded. Sets `snapshot`; checks it with VENV's transformers.
setup_tokenizer() { # venv name
  export HF_HOME="$workdir/hf"
  export HF_HUB_CACHE="$HF_HOME/hub"
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
  snapshot=$(python3 "$here/gateway_aiperf.py" tokenizer --hub-cache "$HF_HUB_CACHE" --name "$2")
  "$1/bin/python" - "local/$2" <<'PY'
import sys
from transformers import AutoTokenizer
t = AutoTokenizer.from_pretrained(sys.argv[1])
assert len(t.encode("a\nb", add_special_tokens=False)) == 3, "one token per character"
PY
}

# wait_workers URL N NAME LOG: until GET URL/workers lists N ready workers (smg's and kvroute's
# shapes), 60 s at most; else the log's end and exit.
wait_workers() {
  if ! python3 - "$1" "$2" <<'PY'; then
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
    echo "$3 did not list $2 ready workers within 60 s:" >&2
    tail -20 "$4" >&2
    exit 1
  fi
}

# wait_log FILE TEXT: until FILE holds TEXT, 10 s at most; else the file and exit.
wait_log() {
  for _ in $(seq 1 100); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  cat "$1" >&2
  exit 1
}

# Bookings left on kvroute (GET /loads): the sum of every rank's counters, 0 when none is left.
bookings_left() { # url
  python3 - "$1" <<'PY'
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
overlap_tokens() { # url
  python3 - "$1" <<'PY'
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

# run_aiperf OUT_DIR LOG URL [extra aiperf flags]: one open-loop aiperf run on the client CPUs,
# the workload of the knobs MODEL, TOKENIZER_NAME, PREFIXES, PREFIX_TOKENS, USER_TOKENS,
# OUTPUT_TOKENS, REQUESTS, RATE, SEED, REQUEST_TIMEOUT, RUN_TIMEOUT. Returns aiperf's status.
# --num-dataset-entries REQUESTS: every request its own user part (aiperf's default of 100
# entries would repeat whole prompts).
run_aiperf() {
  local out=$1 log=$2 url=$3
  shift 3
  taskset -c "$client_cpus" timeout --kill-after=10 "$RUN_TIMEOUT" "$aiperf" profile \
    --model "$MODEL" --tokenizer "local/$TOKENIZER_NAME" --url "$url" \
    --endpoint-type chat --streaming --use-server-token-count \
    --num-prefix-prompts "$PREFIXES" --prefix-prompt-length "$PREFIX_TOKENS" \
    --isl "$USER_TOKENS" --isl-stddev 0 --osl "$OUTPUT_TOKENS" --osl-stddev 0 \
    --extra-inputs ignore_eos:true \
    --num-dataset-entries "$REQUESTS" --request-count "$REQUESTS" \
    --request-rate "$RATE" --arrival-pattern poisson --random-seed "$SEED" \
    --request-timeout-seconds "$REQUEST_TIMEOUT" \
    --no-server-metrics --no-gpu-telemetry --ui-type none \
    --artifact-dir "$out" "$@" >"$log" 2>&1
}

# The commit of the checkout, `-dirty` when crates/ or the Cargo files differ.
commit_id() {
  local commit
  commit=$(git -C "$repo" rev-parse --short=7 HEAD 2>/dev/null || echo unknown)
  git -C "$repo" diff --quiet HEAD -- crates Cargo.toml Cargo.lock 2>/dev/null || commit="$commit-dirty"
  echo "$commit"
}

machine() { echo "$(nproc) cores, $(awk -F': *' '/^model name/ {print $2; exit}' /proc/cpuinfo)"; }
