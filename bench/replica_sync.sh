#!/usr/bin/env bash
# Throughput cost of replica sync on POST /select_and_reserve: `kvroute loadgen --mode reserve`
# (select_and_reserve → DELETE) against one replica without NATS ("off"), then against one of two
# replicas sharing a local nats-server ("on"; the other replica applies every booking), same
# machine, alternating ROUNDS times. Prints loadgen's table per run. Refuses to start when one of
# its ports (NATS_PORT, PORT, PORT+1) is already taken, so it never measures someone else's server.
#   cargo build --release -p kvroute && bash bench/replica_sync.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${KVROUTE_BIN:-${CARGO_TARGET_DIR:-target}/release/kvroute}
nats_server=${KVROUTE_NATS_SERVER:-$(command -v nats-server || echo /usr/sbin/nats-server)}
duration=${DURATION:-8}
concurrency=${CONCURRENCY:-16}
rounds=${ROUNDS:-3}
nats_port=${NATS_PORT:-24222}
port=${PORT:-28100}
peer_port=$((port + 1))

in_use() { (echo >/dev/tcp/127.0.0.1/"$1") 2>/dev/null; }
for p in "$nats_port" "$port" "$peer_port"; do
    if in_use "$p"; then
        echo "port $p is already in use (set NATS_PORT / PORT)" >&2
        exit 1
    fi
done
store=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$store"
}
trap cleanup EXIT
# Waits until process $2 listens on port $1 (fails if it exited).
wait_port() {
    for _ in $(seq 100); do
        kill -0 "$2" 2>/dev/null || { echo "process $2 exited" >&2; return 1; }
        in_use "$1" && return 0
        sleep 0.1
    done
    echo "nothing listens on port $1" >&2
    return 1
}
start() { # start PORT ARGS…: a kvroute serve in the background, waited for
    local listen=$1
    shift
    "$bin" serve --port "$listen" "$@" >/dev/null 2>&1 &
    local pid=$!
    pids+=("$pid")
    run+=("$pid")
    wait_port "$listen" "$pid"
}

"$nats_server" -a 127.0.0.1 -p "$nats_port" -js -sd "$store" >/dev/null 2>&1 &
pids+=($!)
wait_port "$nats_port" $!
for round in $(seq "$rounds"); do
    for sync in off on; do
        run=()
        if [ "$sync" = on ]; then
            nats=(--nats-url "nats://127.0.0.1:$nats_port" --nats-prefix "bench$round")
            start "$peer_port" "${nats[@]}" --replica-id r2
            start "$port" "${nats[@]}" --replica-id r1
        else
            start "$port"
        fi
        echo "== round $round, sync $sync"
        "$bin" loadgen --url "http://127.0.0.1:$port" --workers 16 --block-size 16 \
            --concurrency "$concurrency" --duration-secs "$duration" --mode reserve \
            --label "sync-$sync"
        for pid in "${run[@]}"; do
            kill "$pid"
            wait "$pid" 2>/dev/null || true
        done
    done
done
