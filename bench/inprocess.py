#!/usr/bin/env python3
"""In-process side by side: kvroute's `kvroute.SelectionService` against Dynamo's
`dynamo.llm.SelectionService` (ai-dynamo-runtime), same interpreter, same prompts, one after the
other in alternating rounds.

    python bench/inprocess.py --workers 64 --tokens 8192 --seconds 3 --rounds 3 --out r.json

Needs an interpreter with both installed (side_by_side.sh uses bench/.venv, into which it
installs the kvroute wheel) and, because Dynamo's workers need a KV-event endpoint to be
schedulable, runs where 127.0.0.1 is private (side_by_side.sh's namespace): each worker names
tcp://127.0.0.1:<port> where nothing publishes.

Per server and round: awaited `select` calls one at a time for `--seconds`, then as many full
cycles (select with a selection_id → create_reservation → prefill_complete →
free_reservation). Prompts are `--tokens` long, 64-token blocks, sharing prefixes as Mooncake's
conversation trace does when `--trace` is given (else 16 prefix groups). kvroute gets its token
ids as the list (the form Dynamo takes) and as an `array('I')` (the buffer form).
Writes per-run calls/s and p50/p99 in µs as JSON and prints a markdown table.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import random
import statistics
import time

BLOCK = 64


def prompts(count: int, tokens: int, trace: str | None, seed: int = 7) -> list[list[int]]:
    """`count` prompts of `tokens` tokens. With a Mooncake trace, each 512-token hash id becomes
    the same 512 tokens wherever it appears (so shared prefixes stay shared), the prompt cut or
    padded to `tokens`; else 16 groups sharing a half-prompt prefix."""
    rng = random.Random(seed)
    out = []
    if trace:
        with open(trace) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for row in rows[:count]:
            ids = row["hash_ids"]
            prompt = []
            for h in ids:
                base = h * 512
                prompt.extend((base + t) % 150_000 + 1 for t in range(512))
            while len(prompt) < tokens:
                prompt.extend(rng.randrange(1, 150_000) for _ in range(512))
            out.append(prompt[:tokens])
    while len(out) < count:
        group = len(out) % 16
        head = [(group * 7919 + t) % 150_000 + 1 for t in range(tokens // 2)]
        out.append(head + [rng.randrange(1, 150_000) for _ in range(tokens - len(head))])
    return out


async def register(svc, workers: int, events_base: int):
    for w in range(1, workers + 1):
        await svc.upsert_worker({
            "worker_id": w,
            "endpoint": f"http://127.0.0.1:{9000 + w}",
            "block_size": BLOCK,
            "kv_events_endpoint": f"tcp://127.0.0.1:{events_base + w}",
        })


def summary(samples: list[float], elapsed: float) -> dict:
    samples.sort()
    return {
        "calls": len(samples),
        "per_s": len(samples) / elapsed,
        "p50_us": samples[len(samples) // 2],
        "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))],
        "mean_us": statistics.fmean(samples),
    }


async def run_select(svc, requests, seconds: float) -> dict:
    samples = []
    start = time.perf_counter()
    deadline = start + seconds
    i = 0
    while time.perf_counter() < deadline and i < 10_000_000:
        t0 = time.perf_counter()
        await svc.select(requests[i % len(requests)])
        samples.append((time.perf_counter() - t0) * 1e6)
        i += 1
    return summary(samples, time.perf_counter() - start)


async def run_cycle(svc, requests, seconds: float, tag: str) -> dict:
    samples = []
    start = time.perf_counter()
    deadline = start + seconds
    i = 0
    while time.perf_counter() < deadline and i < 10_000_000:
        sid = f"{tag}-{i}"
        request = dict(requests[i % len(requests)])
        request["selection_id"] = sid
        t0 = time.perf_counter()
        await svc.select(request)
        await svc.create_reservation({"selection_id": sid})
        await svc.prefill_complete(sid)
        await svc.free_reservation(sid)
        samples.append((time.perf_counter() - t0) * 1e6)
        i += 1
    return summary(samples, time.perf_counter() - start)


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trace")
    ap.add_argument("--events-base", type=int, default=28000)
    ap.add_argument("--out")
    args = ap.parse_args()

    import kvroute
    from dynamo.llm import SelectionService as DynamoService

    ps = prompts(args.prompts, args.tokens, args.trace)
    kv = kvroute.SelectionService(profile="dynamo")
    dyn = DynamoService()
    await register(kv, args.workers, args.events_base)
    await register(dyn, args.workers, args.events_base + args.workers + 1)
    forms = {
        "dynamo": (dyn, [{"token_ids": p} for p in ps]),
        "kvroute-list": (kv, [{"token_ids": p} for p in ps]),
        "kvroute-array": (kv, [{"token_ids": array.array("I", p)} for p in ps]),
    }
    for svc, requests in forms.values():  # warm-up
        await run_select(svc, requests, 0.5)
    results = {name: {"select": [], "cycle": []} for name in forms}
    for r in range(args.rounds):
        order = list(forms) if r % 2 == 0 else list(reversed(forms))
        for name in order:
            svc, requests = forms[name]
            results[name]["select"].append(await run_select(svc, requests, args.seconds))
            results[name]["cycle"].append(await run_cycle(svc, requests, args.seconds, f"{name}-{r}"))
    kv.shutdown()
    dyn.shutdown()

    def med(runs, key):
        return statistics.median(run[key] for run in runs)

    table = {"workers": args.workers, "tokens": args.tokens, "runs": results, "median": {}}
    print(f"\nIn process, {args.tokens}-token prompts, {args.workers} workers, "
          f"median of {args.rounds} rounds of {args.seconds:g} s\n")
    print("| server | select/s | select p50 µs | p99 µs | cycles/s | cycle p50 µs | p99 µs |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        m = {f"{op}_{k}": med(runs[op], k) for op in ("select", "cycle") for k in ("per_s", "p50_us", "p99_us")}
        table["median"][name] = m
        print(f"| {name} | {m['select_per_s']:,.0f} | {m['select_p50_us']:.0f} | {m['select_p99_us']:.0f} "
              f"| {m['cycle_per_s']:,.0f} | {m['cycle_p50_us']:.0f} | {m['cycle_p99_us']:.0f} |")
    d = table["median"]["dynamo"]
    for name in ("kvroute-list", "kvroute-array"):
        k = table["median"][name]
        print(f"{name} / dynamo: select {k['select_per_s'] / d['select_per_s']:.1f}x, "
              f"cycle {k['cycle_per_s'] / d['cycle_per_s']:.1f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
