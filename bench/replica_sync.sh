#!/usr/bin/env bash
# Throughput cost of replica sync on POST /select_and_reserve: `kvroute loadgen --mode reserve`
# (select_and_reserve → DELETE) against one replica without NATS ("off"), then against one of two
# replicas sharing a local nats-server ("on"; the other replica applies every booking), same
# machine, alternating ROUNDS times. Prints loadgen's table per run.
#   cargo build --release -p kvroute && bash bench/replica_sync.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${KVROUTE_BIN:-${CARGO_TARGET_DIR:-target}/release/kvroute}
nats_server=${KVROUTE_NATS_SERVER:-$(command -v nats-server || echo /usr/sbin/nats-server)}
duration=${DURATION:-8}
concurrency=${CONCURRENCY:-16}
rounds=${ROUNDS:-3}
store=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$store"
}
trap cleanup EXIT
"$nats_server" -a 127.0.0.1 -p 14222 -js -sd "$store" >/dev/null 2>&1 &
pids+=($!)
wait_port() {
    for _ in $(seq 100); do
        (echo >/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0
        sleep 0.1
    done
    echo "nothing listens on port $1" >&2
    return 1
}
wait_port 14222
for round in $(seq "$rounds"); do
    for sync in off on; do
        run=()
        if [ "$sync" = on ]; then
            prefix="bench$round"
            "$bin" serve --port 18101 --nats-url nats://127.0.0.1:14222 --replica-id r2 \
                --nats-prefix "$prefix" >/dev/null 2>&1 &
            run+=($!)
            wait_port 18101
            "$bin" serve --port 18100 --nats-url nats://127.0.0.1:14222 --replica-id r1 \
                --nats-prefix "$prefix" >/dev/null 2>&1 &
        else
            "$bin" serve --port 18100 >/dev/null 2>&1 &
        fi
        run+=($!)
        pids+=("${run[@]}")
        wait_port 18100
        echo "== round $round, sync $sync"
        "$bin" loadgen --url http://127.0.0.1:18100 --workers 16 --block-size 16 \
            --concurrency "$concurrency" --duration-secs "$duration" --mode reserve \
            --label "sync-$sync"
        for pid in "${run[@]}"; do kill "$pid"; wait "$pid" 2>/dev/null || true; done
    done
done
