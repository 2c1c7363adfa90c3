#!/usr/bin/env python3
"""Registers workers FROM..=TO with a server over one keep-alive connection, as `kvroute
loadgen` would (block size 64, a KV-event endpoint each at tcp://127.0.0.1:(BASE + id)), and
reports the registrations' latency and the server's resident memory before and after.

    python3 bench/fleet_register.py --port 18082 --from 65 --to 1000 --events-base 41000 \
        --pid 1234 --out reg.json

Used by side_by_side.sh's fleet phase; memory per registered worker is the RSS growth over the
workers added (listeners and their sockets included).
"""

import argparse
import http.client
import json
import time


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--from", dest="first", type=int, required=True)
    ap.add_argument("--to", dest="last", type=int, required=True)
    ap.add_argument("--events-base", type=int, required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--settle-secs", type=float, default=2.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    rss_before = rss_kib(args.pid)
    conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=30)
    samples = []
    # A server may close a keep-alive connection after some requests (Dynamo's did, past a
    # thousand): the upsert is idempotent, so it is sent again on a new connection.
    reconnects = 0
    start = time.perf_counter()
    for worker_id in range(args.first, args.last + 1):
        body = json.dumps({
            "worker_id": worker_id,
            "endpoint": f"http://worker-{worker_id}:8000",
            "block_size": 64,
            "kv_events_endpoint": f"tcp://127.0.0.1:{args.events_base + worker_id}",
        })
        for attempt in range(3):
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/workers", body, {"Content-Type": "application/json"})
                reply = conn.getresponse()
                data = reply.read()
                break
            except (ConnectionError, http.client.HTTPException):
                if attempt == 2:
                    raise
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=30)
                reconnects += 1
        samples.append((time.perf_counter() - t0) * 1e6)
        if reply.status not in (200, 201):
            raise SystemExit(f"registering worker {worker_id}: {reply.status} {data[:200]!r}")
    elapsed = time.perf_counter() - start
    # Listeners start (and allocate) after the answer: let them settle before reading RSS.
    time.sleep(args.settle_secs)
    rss_after = rss_kib(args.pid)
    samples.sort()
    added = args.last - args.first + 1
    out = {
        "workers_added": added,
        "reconnects": reconnects,
        "registration_s": elapsed,
        "registrations_per_s": added / elapsed if elapsed > 0 else 0,
        "registration_p50_us": samples[len(samples) // 2] if samples else 0,
        "registration_p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))] if samples else 0,
        "rss_before_kib": rss_before,
        "rss_after_kib": rss_after,
        "rss_per_worker_kib": (rss_after - rss_before) / added if added else 0,
    }
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
