#!/usr/bin/env python3
"""Registers workers FROM..=TO with a server over one keep-alive connection, as `kvroute
loadgen --event-workers N` would (block size 64; workers 1..=N a KV-event endpoint each at
tcp://127.0.0.1:(BASE + id), the others none), and reports the registrations' latency, the
lifecycles the server gave them, and the server's resident memory and open files before and after.

    python3 bench/fleet_register.py --port 18082 --from 65 --to 1000 --events-base 41000 \
        --event-workers 1800 --pid 1234 --out reg.json

A worker without a KV-event endpoint is listed as incomplete (not schedulable) by Dynamo and
as schedulable (on load alone) by kvroute; the lifecycles each server gave are recorded. Dynamo
1.6.1 holds ten file descriptors per endpoint (a ZMQ context each), so under a 20,000-file
limit it cannot hold 2,000 workers that have one.

Used by side_by_side.sh's fleet phase; memory per registered worker is the RSS growth over the
workers added (listeners and their sockets included).
"""

import argparse
import http.client
import json
import os
import time


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def open_files(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--from", dest="first", type=int, required=True)
    ap.add_argument("--to", dest="last", type=int, required=True)
    ap.add_argument("--events-base", type=int, required=True)
    ap.add_argument("--event-workers", type=int, default=None,
                    help="only workers 1..=N get a KV-event endpoint (default: all)")
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--settle-secs", type=float, default=2.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    rss_before = rss_kib(args.pid)
    fds_before = open_files(args.pid)
    lifecycles = {}
    conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=30)
    samples = []
    # A server may close a keep-alive connection after some requests (Dynamo's did, past a
    # thousand): the upsert is idempotent, so it is sent again on a new connection.
    reconnects = 0
    start = time.perf_counter()
    for worker_id in range(args.first, args.last + 1):
        spec = {
            "worker_id": worker_id,
            "endpoint": f"http://worker-{worker_id}:8000",
            "block_size": 64,
        }
        if args.event_workers is None or worker_id <= args.event_workers:
            spec["kv_events_endpoint"] = f"tcp://127.0.0.1:{args.events_base + worker_id}"
        body = json.dumps(spec)
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
        try:
            lifecycle = json.loads(data).get("lifecycle", "?")
        except (ValueError, AttributeError):
            lifecycle = "?"
        lifecycles[lifecycle] = lifecycles.get(lifecycle, 0) + 1
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
        "event_workers": args.event_workers,
        "lifecycles": lifecycles,
        "open_files_before": fds_before,
        "open_files_after": open_files(args.pid),
    }
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
