#!/usr/bin/env bash
# Live side by side of disaggregated prefill/decode (P/D) fronts, with an unmodified client
# (NVIDIA's `aiperf`, PyPI), each in front of PREFILL + DECODE fresh mock engines
# (`kvroute fake-engine --openai --role prefill|decode`, KV events on), one after the other:
#   kvroute-sglang  `kvroute gateway --pd-protocol sglang`
#   smg             `smg launch --pd-disaggregation` (PyPI smg), cache_aware prefill policy,
#                   SMG_DECODE_POLICY decode policy (round_robin)
#   kvroute-vllm    `kvroute gateway --pd-protocol vllm`
#   vllm-router     `vllm-router --vllm-pd-disaggregation` (PyPI vllm-router), cache_aware
#                   prefill policy (VLLM_ROUTER_PREFILL_POLICY; its kv_aware cannot read the
#                   mock's KV events, see EVENTS_ENCODING), VLLM_ROUTER_DECODE_POLICY
#                   (round_robin). It sends NixlConnector's two legs as the engines expect.
# on the few-hot-system-prompts workload of bench/gateway_aiperf.sh: streaming chat, PREFIXES
# shared prefixes of PREFIX_TOKENS tokens before a USER_TOKENS-token user part of its own,
# OUTPUT_TOKENS output tokens, Poisson arrivals at RATE requests/s, REQUESTS requests.
#
#   bash bench/pd_live.sh                                   # builds kvroute (release) first
#   KVROUTE_BIN=target/release/kvroute bash bench/pd_live.sh
#   FRONTS="kvroute-sglang smg" bash bench/pd_live.sh
#
# Method (the rest as bench/gateway_aiperf.sh, whose machinery is bench/aiperf_common.sh)
# - Engines: the SGLang fronts get engines of `--pd-protocol sglang` (each prefill engine a
#   bootstrap server on its own port), the vLLM fronts engines of `--pd-protocol vllm`
#   (NixlConnector's kv_transfer_params); a decode engine refuses a leg of the wrong protocol.
#   smg picks its P/D flow from the engines' /v1/models `owned_by` (the mock says `sglang`).
#   The decode engine waits the modelled KV transfer (the mock's 100 Gbit/s, Llama-3-8B-sized
#   KV) × TIME_SCALE. Fresh engines and server per front, the same --random-seed for each.
# - Decode policies: the KV reaches a decode engine by transfer, so its cache earns a decode
#   pick nothing; with equal output lengths round robin spreads decode load evenly.
# - Measured: aiperf's TTFT, ITL, request latency and failures; each engine's counters from its
#   GET /metrics (requests, prompt and cached tokens): how the requests spread over the prefill
#   engines, the prefill engines' prefix-cache hits, and bypasses (decode requests without a
#   prefill leg); after a kvroute run its GET /loads (no booking may be left). aiperf's own
#   cached-token figure is not compared: vllm-router rewrites it to the prefill leg's, the
#   other fronts pass the decode engine's (which counts the transferred blocks).
#
# About 4 minutes on 2 cores (the venv and build aside). Writes
# bench/results/pd-live-<UTC start>.json and .md and prints the table. Needs python3
# (3.10+), PyPI access for the venv (or a venv holding the pinned aiperf, smg and vllm-router:
# PD_VENV), and nothing but 127.0.0.1.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
cd "$repo"

FRONTS="${FRONTS:-kvroute-sglang smg kvroute-vllm vllm-router}"
PREFILL="${PREFILL:-2}"
DECODE="${DECODE:-4}"
TIME_SCALE="${TIME_SCALE:-3}"
BLOCK_SIZE="${BLOCK_SIZE:-16}"
# The engines' KV-event layout, array or map (kvroute reads both; smg and vllm-router's
# cache_aware route on text). vllm-router's kv_aware reads neither: it wants an array batch of
# map events ("KV event must be a tagged map", "KV event batch must be an array").
EVENTS_ENCODING="${EVENTS_ENCODING:-array}"
MODEL="${MODEL:-mock}"
REQUESTS="${REQUESTS:-400}"
RATE="${RATE:-16}"
PREFIXES="${PREFIXES:-3}"
PREFIX_TOKENS="${PREFIX_TOKENS:-4096}"
USER_TOKENS="${USER_TOKENS:-768}"
OUTPUT_TOKENS="${OUTPUT_TOKENS:-192}"
SEED="${SEED:-7}"
REQUEST_TIMEOUT="${REQUEST_TIMEOUT:-120}"
RUN_TIMEOUT="${RUN_TIMEOUT:-240}"
AIPERF_VERSION="${AIPERF_VERSION:-0.13.0}"
SMG_VERSION="${SMG_VERSION:-1.13.0}"
VLLM_ROUTER_VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
SMG_DECODE_POLICY="${SMG_DECODE_POLICY:-round_robin}"
VLLM_ROUTER_PREFILL_POLICY="${VLLM_ROUTER_PREFILL_POLICY:-cache_aware}"
VLLM_ROUTER_DECODE_POLICY="${VLLM_ROUTER_DECODE_POLICY:-round_robin}"
KVROUTE_GATEWAY_FLAGS="${KVROUTE_GATEWAY_FLAGS:-}"
SERVER_PORT="${SERVER_PORT:-19390}"
METRICS_PORT="${METRICS_PORT:-19391}"
ENGINE_PORT_BASE="${ENGINE_PORT_BASE:-19400}"
EVENTS_PORT_BASE="${EVENTS_PORT_BASE:-19500}"
BOOTSTRAP_PORT_BASE="${BOOTSTRAP_PORT_BASE:-19600}"
TOKENIZER_NAME="${TOKENIZER_NAME:-charchat}"
venv="${PD_VENV:-$here/.venv-pd}"
stamp="$(date -u +%Y-%m-%dT%H-%M-%SZ)"
workdir="$(mktemp -d)"
# shellcheck source=bench/aiperf_common.sh
. "$here/aiperf_common.sh"
split_cpus

packages=("aiperf==$AIPERF_VERSION" "smg==$SMG_VERSION" "vllm-router==$VLLM_ROUTER_VERSION")
say "venv $venv: ${packages[*]}$([ -z "${KVROUTE_BIN:-}" ] && echo '; building kvroute (release)')"
ensure_venv "$venv" "${packages[@]}" &
pip_pid=$!
build_kvroute
if ! wait "$pip_pid"; then
  echo "installing ${packages[*]} into $venv failed" >&2
  exit 1
fi
aiperf="$venv/bin/aiperf"
setup_tokenizer "$venv" "$TOKENIZER_NAME"
if ! "$kvroute" gateway --help | grep -q -- --pd-protocol; then
  echo "$kvroute gateway has no --pd-protocol" >&2
  exit 1
fi

engines=$((PREFILL + DECODE))
# Engine i: prefill for i < PREFILL, then decode.
url_of() { echo "http://127.0.0.1:$((ENGINE_PORT_BASE + $1))"; }
events_of() { echo "tcp://127.0.0.1:$((EVENTS_PORT_BASE + $1))"; }
role_of() { if [ "$1" -lt "$PREFILL" ]; then echo prefill; else echo decode; fi; }

engine_pids=()
start_engines() { # protocol
  local i extra
  engine_pids=()
  for i in $(seq 0 $((engines - 1))); do
    extra=()
    if [ "$1" = sglang ] && [ "$(role_of "$i")" = prefill ]; then
      extra+=(--bootstrap-port $((BOOTSTRAP_PORT_BASE + i)))
    fi
    taskset -c "$client_cpus" "$kvroute" fake-engine --openai --port $((ENGINE_PORT_BASE + i)) \
      --role "$(role_of "$i")" --pd-protocol "$1" "${extra[@]}" \
      --model "$MODEL" --block-size "$BLOCK_SIZE" --bind "$(events_of "$i")" \
      --encoding "$EVENTS_ENCODING" --tokenizer "$snapshot/tokenizer.json" --time-scale "$TIME_SCALE" \
      >"$workdir/engine-$i.log" 2>&1 &
    engine_pids+=($!)
    pids+=($!)
  done
  for i in $(seq 0 $((engines - 1))); do wait_log "$workdir/engine-$i.log" "serving model"; done
}

server_url="http://127.0.0.1:$SERVER_PORT"
server_pid=
start_server() { # front
  local front=$1 args=() i log="$workdir/$1-server.log"
  case "$front" in
    kvroute-sglang | kvroute-vllm)
      for i in $(seq 0 $((engines - 1))); do
        if [ "$(role_of "$i")" = prefill ]; then
          local boot=""
          [ "$front" = kvroute-sglang ] && boot="@$((BOOTSTRAP_PORT_BASE + i))"
          args+=(--prefill "$(url_of "$i")=$(events_of "$i")$boot")
        else
          args+=(--decode "$(url_of "$i")=$(events_of "$i")")
        fi
      done
      # shellcheck disable=SC2206 # word splitting of the flag string is wanted
      args+=($KVROUTE_GATEWAY_FLAGS)
      taskset -c "$server_cpus" "$kvroute" gateway --bind 127.0.0.1 --port "$SERVER_PORT" \
        --model "$MODEL" --block-size "$BLOCK_SIZE" --tokenizer "$MODEL=$snapshot" \
        --pd-protocol "${front#kvroute-}" "${args[@]}" >"$log" 2>&1 &
      ;;
    smg)
      for i in $(seq 0 $((engines - 1))); do
        if [ "$(role_of "$i")" = prefill ]; then
          args+=(--prefill "$(url_of "$i")" $((BOOTSTRAP_PORT_BASE + i)))
        else
          args+=(--decode "$(url_of "$i")")
        fi
      done
      taskset -c "$server_cpus" "$venv/bin/smg" launch --host 127.0.0.1 --port "$SERVER_PORT" \
        --pd-disaggregation "${args[@]}" --prefill-policy cache_aware \
        --decode-policy "$SMG_DECODE_POLICY" \
        --prometheus-host 127.0.0.1 --prometheus-port "$METRICS_PORT" --log-level warn \
        >"$log" 2>&1 &
      ;;
    vllm-router)
      for i in $(seq 0 $((engines - 1))); do
        if [ "$(role_of "$i")" = prefill ]; then
          args+=(--prefill "$(url_of "$i")")
          # kv_aware reads the prefill engines' KV events.
          if [ "$VLLM_ROUTER_PREFILL_POLICY" = kv_aware ]; then
            args+=(--pd-kv-events "$(url_of "$i")=$(events_of "$i")")
          fi
        else
          args+=(--decode "$(url_of "$i")")
        fi
      done
      taskset -c "$server_cpus" "$venv/bin/vllm-router" --host 127.0.0.1 --port "$SERVER_PORT" \
        --vllm-pd-disaggregation "${args[@]}" --prefill-policy "$VLLM_ROUTER_PREFILL_POLICY" \
        --decode-policy "$VLLM_ROUTER_DECODE_POLICY" --worker-startup-check-interval 1 \
        --prometheus-host 127.0.0.1 --prometheus-port "$METRICS_PORT" --log-level warning \
        >"$log" 2>&1 &
      ;;
    *)
      echo "unknown front $front (kvroute-sglang, smg, kvroute-vllm, vllm-router)" >&2
      exit 2
      ;;
  esac
  server_pid=$!
  pids+=($server_pid)
  if [ "$front" = vllm-router ]; then
    # vllm-router opens its port once every worker answers /health.
    python3 "$here/pd_live.py" wait-models --url "$server_url" --model "$MODEL" \
      || { tail -20 "$log" >&2; exit 1; }
  else
    wait_workers "$server_url" "$engines" "$front" "$log"
  fi
  # The KV-event subscriptions connect in the background: a moment for them.
  sleep 1
}

protocol_of() { case "$1" in smg | kvroute-sglang) echo sglang ;; *) echo vllm ;; esac; }

runs=()
say "fronts: $FRONTS; $PREFILL prefill + $DECODE decode engines at time scale $TIME_SCALE; $REQUESTS requests at $RATE/s (Poisson), $PREFIXES prefixes × $PREFIX_TOKENS + $USER_TOKENS user tokens, $OUTPUT_TOKENS out; server on CPU $server_cpus, engines and aiperf on CPU $client_cpus"
for front in $FRONTS; do
  start_engines "$(protocol_of "$front")"
  start_server "$front"
  out="$workdir/aiperf-$front"
  cpu0=$(cpu_ticks "$server_pid")
  rc=0
  run_aiperf "$out" "$workdir/aiperf-$front.log" "$server_url" || rc=$?
  cpu1=$(cpu_ticks "$server_pid")
  left=null
  overlap='{}'
  if [ "${front%%-*}" = kvroute ]; then
    sleep 0.5
    left=$(bookings_left "$server_url" || echo null)
    overlap=$(overlap_tokens "$server_url" || echo '{}')
  fi
  engine_args=()
  for i in $(seq 0 $((engines - 1))); do engine_args+=(--engine "$(role_of "$i")=$(url_of "$i")"); done
  python3 "$here/pd_live.py" collect --out "$out" --exit-code "$rc" --cpu "$cpu0,$cpu1" \
    --bookings-left "$left" --requests "$REQUESTS" --overlap "$overlap" \
    --protocol "$(protocol_of "$front")" "${engine_args[@]}"
  if [ "$rc" != 0 ]; then
    echo "   aiperf exited $rc against $front; its log's end:" >&2
    tail -30 "$workdir/aiperf-$front.log" >&2
  fi
  mkdir -p "$out"
  cp "$workdir/$front-server.log" "$out/server.log" 2>/dev/null || true
  stop "$server_pid"
  server_pid=
  stop "${engine_pids[@]}"
  runs+=(--run "$front=$out")
  say "$front done (aiperf exit $rc, bookings left $left)"
done

mkdir -p "$here/results"
base="$here/results/pd-live-$stamp"
python3 "$here/pd_live.py" summarize "${runs[@]}" --out-json "$base.json" --out-md "$base.md" \
  --meta "started=$stamp" --meta "commit=$(commit_id)" \
  --meta "kvroute=$("$kvroute" --version 2>/dev/null || echo unknown)" \
  --meta "aiperf=$AIPERF_VERSION" --meta "smg=$SMG_VERSION" \
  --meta "vllm-router=$VLLM_ROUTER_VERSION" --meta "machine=$(machine)" \
  --meta "config=prefill=$PREFILL decode=$DECODE time_scale=$TIME_SCALE block_size=$BLOCK_SIZE events_encoding=$EVENTS_ENCODING requests=$REQUESTS rate=$RATE prefixes=$PREFIXES prefix_tokens=$PREFIX_TOKENS user_tokens=$USER_TOKENS output_tokens=$OUTPUT_TOKENS seed=$SEED server_cpus=$server_cpus client_cpus=$client_cpus" \
  --meta "policies=smg prefill cache_aware, decode $SMG_DECODE_POLICY; vllm-router prefill $VLLM_ROUTER_PREFILL_POLICY, decode $VLLM_ROUTER_DECODE_POLICY" \
  --meta "kvroute_gateway_flags=$KVROUTE_GATEWAY_FLAGS"
say "wrote $base.json and $base.md"
