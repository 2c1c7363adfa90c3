#!/usr/bin/env python3
"""Runs the routing targets with `kvroute sim` and checks them.

Both workloads (the Mooncake conversation trace and the agentic generator), at 2x and 4x
arrivals, with 1 and with 2 router replicas (sync delay 5 ms), event delay 20 ms, 8 workers x
16,384 blocks of 64 tokens, seed 0. For each run it prints the policies' figures and whether
each target holds:

- the default policy (`kvroute`): TTFT mean and p90 <= 0.85 x the better of `dynamo` and
  `cache_aware`, TTFT p99 <= the better one's, hit rate >= the better one's - 1 point, E2E p99
  <= 1.05 x the better one's;
- the no-event LRU model (`kvroute-approx-lru`): hit rate >= `cache_aware`'s - 1 point, TTFT
  mean <= `cache_aware`'s.

Usage: python3 bench/sim_targets.py [--kvroute target/release/kvroute] [--trace PATH]
       [--out DIR] [--only agentic|conversation] [extra kvroute sim flags...]
Benchmark targets, not tests: it exits 0 whatever they say.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
POLICIES = "cache_aware,dynamo,kvroute,kvroute-approx-lru"


def run(binary, workload_args, speedup, replicas, out, extra):
    cmd = [binary, "sim", *workload_args, "--arrival-speedup", str(speedup),
           "--workers", "8", "--kv-blocks", "16384", "--block-size", "64",
           "--event-delay-ms", "20", "--router-replicas", str(replicas),
           "--sync-delay-ms", "5", "--policies", POLICIES, "--no-progress",
           "--out", out, *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "report.json")) as f:
        return cmd, json.load(f)


def check(report):
    p = {x["name"]: x for x in report["policies"]}
    kv, lru, ca = p["kvroute"], p["kvroute-approx-lru"], p["cache_aware"]
    peers = [p["dynamo"], ca]

    def best(key, sub=None):
        vals = [x[key][sub] if sub else x[key] for x in peers]
        return max(vals) if key == "prefix_hit_rate" else min(vals)

    checks = [
        ("TTFT mean <= 0.85x", kv["ttft_ms"]["mean"], 0.85 * best("ttft_ms", "mean")),
        ("TTFT p90 <= 0.85x", kv["ttft_ms"]["p90"], 0.85 * best("ttft_ms", "p90")),
        ("TTFT p99 <= 1x", kv["ttft_ms"]["p99"], best("ttft_ms", "p99")),
        ("hit >= best-1pt", -kv["prefix_hit_rate"], -(best("prefix_hit_rate") - 0.01)),
        ("E2E p99 <= 1.05x", kv["e2e_ms"]["p99"], 1.05 * best("e2e_ms", "p99")),
        ("lru hit >= ca-1pt", -lru["prefix_hit_rate"], -(ca["prefix_hit_rate"] - 0.01)),
        ("lru TTFT mean <= ca", lru["ttft_ms"]["mean"], ca["ttft_ms"]["mean"]),
    ]
    return p, [(name, got <= limit, abs(got), abs(limit)) for name, got, limit in checks]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvroute", default=os.path.join(REPO, "target/release/kvroute"))
    ap.add_argument("--trace", default=os.path.join(
        REPO, "../shared/traces/mooncake/conversation_trace.jsonl"))
    ap.add_argument("--out", default="/tmp/kvroute-sim-targets")
    ap.add_argument("--only", choices=["agentic", "conversation"])
    args, extra = ap.parse_known_args()
    workloads = [("conversation", ["--trace", args.trace]),
                 ("agentic", ["--synthetic", "agentic"])]
    met = total = 0
    for name, wargs in workloads:
        if args.only and args.only != name:
            continue
        if name == "conversation" and not os.path.exists(args.trace):
            print(f"skipping the conversation trace: {args.trace} not found")
            continue
        for speedup in (2, 4):
            for replicas in (1, 2):
                out = os.path.join(args.out, f"{name}-{speedup}x-r{replicas}")
                _, report = run(args.kvroute, wargs, speedup, replicas, out, extra)
                p, results = check(report)
                print(f"\n== {name}, {speedup}x arrivals, {replicas} router replica(s)")
                print(f"{'policy':<20} {'hit':>7} {'mean':>8} {'p90':>8} {'p99':>8} {'E2E p99':>9}")
                for pol in POLICIES.split(","):
                    x = p[pol]
                    print(f"{pol:<20} {100 * x['prefix_hit_rate']:>6.2f}% "
                          f"{x['ttft_ms']['mean']:>8.1f} {x['ttft_ms']['p90']:>8.1f} "
                          f"{x['ttft_ms']['p99']:>8.1f} {x['e2e_ms']['p99']:>9.0f}")
                for cname, ok, got, limit in results:
                    total += 1
                    met += ok
                    unit = "" if "hit" in cname else " ms"
                    if "hit" in cname:
                        got, limit = 100 * got, 100 * limit
                    print(f"  {'met    ' if ok else 'NOT met'} {cname:<20} {got:.2f}{unit} vs {limit:.2f}{unit}")
    print(f"\n{met} of {total} target checks met")


if __name__ == "__main__":
    sys.exit(main())
