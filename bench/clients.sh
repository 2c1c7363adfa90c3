#!/usr/bin/env bash
# The benchmark tools users run, unmodified, against `kvroute gateway` in front of mock engines
# (`kvroute fake-engine --openai`): NVIDIA's aiperf, guidellm and inference-perf (PyPI), each on
# the same shared-prefix workload (PREFIXES system prompts of PREFIX_TOKENS tokens, each request
# one of them plus USER_TOKENS tokens of its own, OUTPUT_TOKENS output tokens, streaming chat with
# the usage on the last chunk), at RATE requests/s for DURATION seconds. Each tool reports its own
# TTFT and inter-token latency; the script puts them in one table and checks that every request
# succeeded and that the gateway held no booking afterwards (GET /loads).
#
#   bash bench/clients.sh                               # builds kvroute (release) first
#   KVROUTE_BIN=target/release/kvroute TOOLS="aiperf guidellm" DURATION=20 bash bench/clients.sh
#   TOOLS="guidellm-responses" ...                      # guidellm through POST /v1/responses
#
# Offline: the tools size their prompts with a Hugging Face tokenizer, which the script writes
# (one token per character; bench/gateway_aiperf.py tokenizer) as a hub cache entry,
# models--local--NAME/snapshots/<40 hex>/ + refs/main, under a private HF_HOME, and the tools run
# with HF_HUB_OFFLINE=1. The engines and the gateway read the same tokenizer.json (the gateway
# its directory, whose chat template renders as the engines do): the gateway's block hashes are
# the engines'. The tools install into bench/.venv-clients (CLIENTS_VENV); inference-perf
# declares Python >= 3.12 but runs on 3.11, so it is installed without that check and with its
# dependencies named here.
#
# Each tool gets fresh engines and a fresh gateway (empty prefix caches) and runs under
# `timeout`; the script exits non-zero when a tool failed, reported an error, or left a booking.
# Writes bench/results/clients-<UTC start>.json and .md (the table) and prints the table;
# KEEP_WORKDIR=1 keeps the tools' own reports and logs (the path is printed).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
cd "$repo"

TOOLS="${TOOLS:-aiperf guidellm inference-perf}"
ENGINES="${ENGINES:-4}"
TIME_SCALE="${TIME_SCALE:-1}"
BLOCK_SIZE="${BLOCK_SIZE:-16}"
MODEL="${MODEL:-mock}"
RATE="${RATE:-4}"
DURATION="${DURATION:-30}"
PREFIXES="${PREFIXES:-4}"
PREFIX_TOKENS="${PREFIX_TOKENS:-1024}"
USER_TOKENS="${USER_TOKENS:-128}"
OUTPUT_TOKENS="${OUTPUT_TOKENS:-64}"
SEED="${SEED:-7}"
REQUEST_TIMEOUT="${REQUEST_TIMEOUT:-60}"
# A tool's whole run: its DURATION, its start-up and its drain.
RUN_TIMEOUT="${RUN_TIMEOUT:-$((DURATION + 240))}"
AIPERF_VERSION="${AIPERF_VERSION:-0.13.0}"
GUIDELLM_VERSION="${GUIDELLM_VERSION:-0.8.1}"
INFERENCE_PERF_VERSION="${INFERENCE_PERF_VERSION:-0.7.0}"
SERVER_PORT="${SERVER_PORT:-18690}"
ENGINE_PORT_BASE="${ENGINE_PORT_BASE:-18700}"
EVENTS_PORT_BASE="${EVENTS_PORT_BASE:-18800}"
TOKENIZER_NAME="${TOKENIZER_NAME:-charchat}"
venv="${CLIENTS_VENV:-$here/.venv-clients}"
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
  if [ -n "${KEEP_WORKDIR:-}" ]; then echo "kept $workdir" >&2; else rm -rf "$workdir"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "venv $venv: aiperf==$AIPERF_VERSION guidellm==$GUIDELLM_VERSION inference-perf==$INFERENCE_PERF_VERSION$([ -z "${KVROUTE_BIN:-}" ] && echo '; building kvroute (release)')"
(
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  if ! "$venv/bin/python" - "$AIPERF_VERSION" "$GUIDELLM_VERSION" "$INFERENCE_PERF_VERSION" 2>/dev/null <<'PY'; then
import importlib.metadata as m, sys
want = dict(zip(("aiperf", "guidellm", "inference-perf"), sys.argv[1:]))
sys.exit(any(m.version(name) != version for name, version in want.items()))
PY
    "$venv/bin/pip" install -q "aiperf==$AIPERF_VERSION" "guidellm==$GUIDELLM_VERSION"
    # inference-perf's own dependencies, but transformers, which aiperf's pin provides.
    "$venv/bin/pip" install -q --no-deps --ignore-requires-python "inference-perf==$INFERENCE_PERF_VERSION"
    "$venv/bin/pip" install -q aiohttp pydantic numpy datasets jinja2 google-cloud-storage pyyaml \
      boto3 uvloop tqdm aiofiles tiktoken rich av pillow prometheus-client
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
  echo "installing the clients into $venv failed" >&2
  exit 1
fi

# The tokenizer, in the hub cache layout, under a private HF_HOME; nothing may be downloaded.
export HF_HOME="$workdir/hf"
export HF_HUB_CACHE="$HF_HOME/hub"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export DO_NOT_TRACK=1 GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL=WARNING
snapshot=$(python3 "$here/gateway_aiperf.py" tokenizer --hub-cache "$HF_HUB_CACHE" --name "$TOKENIZER_NAME")
tokenizer="local/$TOKENIZER_NAME"

engine_pids=()
start_engines() {
  engine_pids=()
  local i
  for i in $(seq 0 $((ENGINES - 1))); do
    "$kvroute" fake-engine --openai --port $((ENGINE_PORT_BASE + i)) --model "$MODEL" \
      --block-size "$BLOCK_SIZE" --bind "tcp://127.0.0.1:$((EVENTS_PORT_BASE + i))" \
      --tokenizer "$snapshot/tokenizer.json" --time-scale "$TIME_SCALE" \
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
stop() {
  local p
  for p in "$@"; do kill "$p" 2>/dev/null || true; done
  for p in "$@"; do
    for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
}

server_url="http://127.0.0.1:$SERVER_PORT"
server_pid=
start_gateway() {
  local args=() i
  for i in $(seq 0 $((ENGINES - 1))); do
    args+=(--worker "http://127.0.0.1:$((ENGINE_PORT_BASE + i))=tcp://127.0.0.1:$((EVENTS_PORT_BASE + i))")
  done
  "$kvroute" gateway --bind 127.0.0.1 --port "$SERVER_PORT" --model "$MODEL" \
    --block-size "$BLOCK_SIZE" --tokenizer "$MODEL=$snapshot" "${args[@]}" \
    >"$workdir/gateway.log" 2>&1 &
  server_pid=$!
  pids+=($server_pid)
  python3 "$here/clients.py" wait-ready --url "$server_url" --workers "$ENGINES" || {
    tail -20 "$workdir/gateway.log" >&2
    exit 1
  }
  # The KV-event subscriptions connect in the background: a moment for them.
  sleep 1
}

run_tool() { # tool out
  local tool=$1 out=$2
  mkdir -p "$out"
  case "$tool" in
    aiperf)
      "$venv/bin/aiperf" profile --model "$MODEL" --tokenizer "$tokenizer" --url "$server_url" \
        --endpoint-type chat --streaming --use-server-token-count \
        --num-prefix-prompts "$PREFIXES" --prefix-prompt-length "$PREFIX_TOKENS" \
        --isl "$USER_TOKENS" --isl-stddev 0 --osl "$OUTPUT_TOKENS" --osl-stddev 0 \
        --extra-inputs ignore_eos:true --extra-inputs "min_tokens:$OUTPUT_TOKENS" \
        --num-dataset-entries $((RATE * DURATION + 16)) \
        --request-rate "$RATE" --benchmark-duration "$DURATION" --benchmark-grace-period 30 \
        --random-seed "$SEED" --request-timeout-seconds "$REQUEST_TIMEOUT" \
        --no-server-metrics --no-gpu-telemetry --ui-type none --artifact-dir "$out"
      ;;
    guidellm | guidellm-responses)
      # guidellm-responses: the same through POST /v1/responses (OpenAI's Responses API).
      local route=/v1/chat/completions
      if [ "$tool" = guidellm-responses ]; then route=/v1/responses; fi
      "$venv/bin/guidellm" run \
        --backend "kind=openai_http,target=$server_url,model=$MODEL,request_format=$route" \
        --tokenizer "kind=huggingface_auto,model=$tokenizer" \
        --data "{\"kind\": \"synthetic_text\", \"prefix_tokens\": $PREFIX_TOKENS, \"prefix_count\": $PREFIXES, \"prompt_tokens\": $USER_TOKENS, \"output_tokens\": $OUTPUT_TOKENS}" \
        --profile "kind=constant,rate=$RATE" --constraint "kind=max_duration,seconds=$DURATION" \
        --seed "kind=static,value=$SEED" --output "kind=json,path=$out/guidellm.json" \
        --disable-console-interactive
      ;;
    inference-perf)
      cat >"$out/config.yml" <<YAML
load:
  type: constant
  stages: [{rate: $RATE, duration: $DURATION}]
  num_workers: 1
  request_timeout: $REQUEST_TIMEOUT
api: {type: chat, streaming: true}
server: {type: vllm, model_name: $MODEL, base_url: "$server_url", ignore_eos: true}
tokenizer: {pretrained_model_name_or_path: "$tokenizer"}
data:
  type: shared_prefix
  shared_prefix:
    num_groups: $PREFIXES
    num_prompts_per_group: $((RATE * DURATION / PREFIXES + 1))
    system_prompt_len: $PREFIX_TOKENS
    question_len: $USER_TOKENS
    output_len: $OUTPUT_TOKENS
    seed: $SEED
report: {request_lifecycle: {summary: true, per_stage: false, per_request: false}}
storage: {local_storage: {path: "$out"}}
YAML
      "$venv/bin/inference-perf" --config_file "$out/config.yml"
      ;;
    *)
      echo "unknown tool $tool (aiperf, guidellm, guidellm-responses, inference-perf)" >&2
      return 2
      ;;
  esac
}

runs=()
failed=0
say "tools: $TOOLS; $ENGINES engines at time scale $TIME_SCALE; $RATE requests/s for $DURATION s each; $PREFIXES prefixes × $PREFIX_TOKENS + $USER_TOKENS user tokens, $OUTPUT_TOKENS out"
for tool in $TOOLS; do
  start_engines
  start_gateway
  out="$workdir/$tool"
  rc=0
  timeout --kill-after=10 "$RUN_TIMEOUT" bash -c "$(declare -f run_tool); $(declare -p venv MODEL tokenizer server_url PREFIXES PREFIX_TOKENS USER_TOKENS OUTPUT_TOKENS RATE DURATION SEED REQUEST_TIMEOUT); run_tool $tool $out" \
    >"$workdir/$tool.log" 2>&1 || rc=$?
  sleep 0.5
  python3 "$here/clients.py" after-run --url "$server_url" --out "$out" --exit-code "$rc"
  if [ "$rc" != 0 ]; then
    echo "   $tool exited $rc; its log's end:" >&2
    tail -30 "$workdir/$tool.log" >&2
  fi
  cp "$workdir/$tool.log" "$out/tool.log"
  stop "$server_pid"
  server_pid=
  stop "${engine_pids[@]}"
  runs+=(--run "$tool=$out")
  say "$tool done (exit $rc)"
done

mkdir -p "$here/results"
base="$here/results/clients-$stamp"
commit=$(git -C "$repo" rev-parse --short=7 HEAD 2>/dev/null || echo unknown)
git -C "$repo" diff --quiet HEAD -- crates Cargo.toml Cargo.lock 2>/dev/null || commit="$commit-dirty"
python3 "$here/clients.py" summarize "${runs[@]}" --out-json "$base.json" --out-md "$base.md" \
  --meta "started=$stamp" --meta "commit=$commit" \
  --meta "versions=aiperf $AIPERF_VERSION, guidellm $GUIDELLM_VERSION, inference-perf $INFERENCE_PERF_VERSION" \
  --meta "machine=$(nproc) cores, $(awk -F': *' '/^model name/ {print $2; exit}' /proc/cpuinfo)" \
  --meta "config=engines=$ENGINES time_scale=$TIME_SCALE block_size=$BLOCK_SIZE rate=$RATE duration=$DURATION prefixes=$PREFIXES prefix_tokens=$PREFIX_TOKENS user_tokens=$USER_TOKENS output_tokens=$OUTPUT_TOKENS seed=$SEED" \
  || failed=1
say "wrote $base.json and $base.md"
exit "$failed"
