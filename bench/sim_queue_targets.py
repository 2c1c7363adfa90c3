#!/usr/bin/env python3
"""Runs the admission queue's targets with `kvroute sim` and checks them.

8 workers x 16,384 blocks of 64 tokens, 20 ms events, seed 0, 8x arrivals, the `kvroute` policy,
the router queue at threshold 1 x max_num_batched_tokens with a 2 s timeout (fcfs unless said):

1. queue on vs off, on the conversation trace and on an overloaded agentic workload
   (`agentic:sessions=2048,session-rate=4`; the default 256 sessions never saturate 8 workers):
   TTFT p99 of admitted requests <= 1/3 of the run without the queue, goodput (TTFT <= 2 s)
   >= 1.5x;
2. two tenants, tenant 0 starting 4x tenant 1's sessions, equal weights
   (`agentic:tenants=2,tenant-skew=4,sessions=2048,session-rate=2`): tenant 1's TTFT p99 within
   1.2x of what it gets alone (`--only-tenant 1`), Jain's index of the tenants' goodput >= 0.95;
3. wspt vs fcfs (no timeout, so nothing is shed): wspt's mean TTFT < fcfs's, fcfs's p99 <=
   wspt's.

Usage: python3 bench/sim_queue_targets.py [--kvroute target/release/kvroute] [--trace PATH]
       [extra kvroute sim flags...]. Benchmark targets, not tests: it exits 0 whatever they say.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BASE = ["--arrival-speedup", "8", "--workers", "8", "--kv-blocks", "16384", "--block-size", "64",
        "--event-delay-ms", "20", "--policies", "kvroute", "--no-progress"]
QUEUE = ["--queue-threshold", "1", "--queue-timeout-ms", "2000"]
OVERLOADED = "agentic:sessions=2048,session-rate=4"
TENANTS = "agentic:tenants=2,tenant-skew=4,sessions=2048,session-rate=2"


def sim(binary, args):
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([binary, "sim", *BASE, *args, "--out", out], check=True,
                       stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "report.json")) as f:
            return json.load(f)["policies"][0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvroute", default=os.path.join(REPO, "target/release/kvroute"))
    ap.add_argument("--trace", default=os.path.join(
        REPO, "../shared/traces/mooncake/conversation_trace.jsonl"))
    args, extra = ap.parse_known_args()
    results = []

    def check(name, ok, detail):
        results.append(ok)
        print(f"  {'met    ' if ok else 'NOT met'} {name}: {detail}")

    workloads = [("agentic, overloaded", ["--synthetic", OVERLOADED])]
    if os.path.exists(args.trace):
        workloads.insert(0, ("conversation", ["--trace", args.trace]))
    for name, w in workloads:
        off = sim(args.kvroute, [*w, *extra])
        on = sim(args.kvroute, [*w, *QUEUE, *extra])
        print(f"== {name}, 8x: queue off / on")
        for label, p in (("off", off), ("on", on)):
            print(f"  {label:<3} TTFT mean {p['ttft_ms']['mean']:.0f} ms, p99 "
                  f"{p['ttft_ms']['p99']:.0f} ms, goodput {100 * p['goodput_share']:.2f} %, "
                  f"shed {p['shed_timed_out'] + p['shed_queue_full']}, E2E p99 "
                  f"{p['e2e_ms']['p99']:.0f} ms")
        check("TTFT p99 <= 1/3", on["ttft_ms"]["p99"] <= off["ttft_ms"]["p99"] / 3,
              f"{on['ttft_ms']['p99']:.0f} vs {off['ttft_ms']['p99'] / 3:.0f} ms")
        check("goodput >= 1.5x", on["goodput_requests"] >= 1.5 * off["goodput_requests"],
              f"{on['goodput_requests']} vs {1.5 * off['goodput_requests']:.0f} requests")

    mixed = sim(args.kvroute, ["--synthetic", TENANTS, *QUEUE, *extra])
    alone = sim(args.kvroute, ["--synthetic", TENANTS, *QUEUE, "--only-tenant", "1", *extra])
    small = next(t for t in mixed["tenants"] if t["tenant"] == "tenant-1")
    print("== two tenants (4:1), equal weights, queue on")
    for t in mixed["tenants"]:
        print(f"  {t['tenant']}: {t['requests']} requests, goodput {100 * t['goodput_share']:.2f} %,"
              f" TTFT p99 {t['ttft_ms']['p99']:.0f} ms, router queue mean "
              f"{t['queue_wait_ms']['mean']:.0f} ms, shed {t['shed']}")
    print(f"  tenant-1 alone: TTFT p99 {alone['ttft_ms']['p99']:.0f} ms")
    check("small tenant p99 <= 1.2x alone", small["ttft_ms"]["p99"] <= 1.2 * alone["ttft_ms"]["p99"],
          f"{small['ttft_ms']['p99']:.0f} vs {1.2 * alone['ttft_ms']['p99']:.0f} ms")
    goods = [t["requests"] * t["goodput_share"] for t in mixed["tenants"]]
    jain = sum(goods) ** 2 / (len(goods) * sum(g * g for g in goods))
    check("Jain's index of goodput >= 0.95", jain >= 0.95,
          f"{jain:.3f} (good requests {', '.join(f'{g:.0f}' for g in goods)}; "
          f"the report's tenant_fairness: {mixed['tenant_fairness']})")

    for name, w in workloads:
        fcfs = sim(args.kvroute, [*w, "--queue-threshold", "1", *extra])
        wspt = sim(args.kvroute, [*w, "--queue-threshold", "1", "--queue-policy", "wspt", *extra])
        print(f"== {name}, 8x: fcfs vs wspt, no timeout")
        for label, p in (("fcfs", fcfs), ("wspt", wspt)):
            print(f"  {label} TTFT mean {p['ttft_ms']['mean']:.0f} ms, p99 {p['ttft_ms']['p99']:.0f} ms")
        check("wspt mean < fcfs mean", wspt["ttft_ms"]["mean"] < fcfs["ttft_ms"]["mean"],
              f"{wspt['ttft_ms']['mean']:.0f} vs {fcfs['ttft_ms']['mean']:.0f} ms")
        check("fcfs p99 <= wspt p99", fcfs["ttft_ms"]["p99"] <= wspt["ttft_ms"]["p99"],
              f"{fcfs['ttft_ms']['p99']:.0f} vs {wspt['ttft_ms']['p99']:.0f} ms")
    print(f"\n{sum(results)} of {len(results)} target checks met")


if __name__ == "__main__":
    sys.exit(main())
