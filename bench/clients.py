#!/usr/bin/env python3
"""Helpers of bench/clients.sh (standard library only).

  wait-ready --url URL --workers N
      Waits (60 s at most) until the gateway's GET /workers lists N workers.
  after-run --url URL --out DIR --exit-code RC
      Writes DIR/after.json: the tool's exit code and the bookings the gateway still holds
      (GET /loads: every rank's active requests, potential prefill tokens and decode blocks,
      and the partitions' queued requests; 0 when none is left).
  summarize --run TOOL=DIR ... --out-json F --out-md F [--meta KEY=VALUE ...]
      Reads each tool's own report and writes one JSON and one markdown table of the figures
      each tool measured: requests completed and failed, TTFT and inter-token latency (mean,
      p50, p99, ms), output tokens/s; exits 1 when a tool failed, counted an error or left a
      booking.

Each tool names its figures its own way; what is read:
  aiperf          profile_export_aiperf.json: time_to_first_token, inter_token_latency,
                  request_count, error_request_count, output_token_throughput
  guidellm        guidellm.json: benchmarks[0].metrics.time_to_first_token_ms,
                  inter_token_latency_ms (successful requests), request_totals,
                  output_tokens_per_second
  inference-perf  summary_lifecycle_metrics.json: successes.latency.time_to_first_token,
                  inter_token_latency (seconds), successes.count, failures.count,
                  successes.throughput.output_tokens_per_sec
"""

import argparse
import glob
import json
import os
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gateway_aiperf  # noqa: E402  (its reader of aiperf's export)


def get_json(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def wait_ready(args):
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            body = get_json(args.url + "/workers")
            items = body.get("workers", []) if isinstance(body, dict) else body
            if len(items) >= args.workers:
                return 0
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    print(f"{args.url} did not list {args.workers} workers within 60 s", file=sys.stderr)
    return 1


def bookings_left(url):
    left = 0
    for partition in get_json(url + "/loads"):
        left += partition.get("pending_count", 0) or 0
        for rank in partition.get("loads", []):
            for key in ("active_requests", "potential_prefill_tokens", "potential_decode_blocks"):
                left += rank.get(key, 0) or 0
    return left


def after_run(args):
    os.makedirs(args.out, exist_ok=True)
    try:
        left = bookings_left(args.url)
    except (OSError, ValueError) as e:
        print(f"GET {args.url}/loads failed: {e}", file=sys.stderr)
        left = None
    with open(os.path.join(args.out, "after.json"), "w") as f:
        json.dump({"exit_code": args.exit_code, "bookings_left": left}, f)
    return 0


def dig(data, *path):
    for key in path:
        if isinstance(data, dict):
            data = data.get(key)
        elif isinstance(data, list) and isinstance(key, int) and len(data) > key:
            data = data[key]
        else:
            return None
    return data


def num(v, scale=1.0):
    return float(v) * scale if isinstance(v, (int, float)) else None


def first(pattern):
    found = sorted(glob.glob(pattern, recursive=True))
    return found[0] if found else None


def read_aiperf(out):
    path = first(os.path.join(out, "**", "profile_export_aiperf.json"))
    if not path:
        return {}
    run = gateway_aiperf.read_run(path)
    row = {"requests_ok": run.get("requests_ok"), "requests_failed": run.get("requests_failed"),
           "output_tokens_per_s": run.get("output_token_throughput")}
    for ours, theirs in (("ttft", "time_to_first_token"), ("itl", "inter_token_latency")):
        for q, key in (("mean", "avg"), ("p50", "p50"), ("p99", "p99")):
            row[f"{ours}_{q}_ms"] = run.get(f"{theirs}_{key}_ms")
    return row


def read_guidellm(out):
    path = os.path.join(out, "guidellm.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    bench = dig(data, "benchmarks", 0) or {}
    metrics = bench.get("metrics", {})
    row = {}
    for ours, theirs in (("ttft", "time_to_first_token_ms"), ("itl", "inter_token_latency_ms")):
        dist = dig(metrics, theirs, "successful") or {}
        row[f"{ours}_mean_ms"] = num(dist.get("mean"))
        row[f"{ours}_p50_ms"] = num(dig(dist, "percentiles", "p50") or dist.get("median"))
        row[f"{ours}_p99_ms"] = num(dig(dist, "percentiles", "p99"))
    totals = dig(metrics, "request_totals") or dig(bench, "request_totals") or {}
    row["requests_ok"] = totals.get("successful")
    row["requests_failed"] = totals.get("errored") or 0
    # In flight when the duration ran out: guidellm cancels them (the client leaves).
    row["requests_cut"] = totals.get("incomplete") or 0
    row["output_tokens_per_s"] = num(dig(metrics, "output_tokens_per_second", "successful", "mean"))
    return row


def read_inference_perf(out):
    path = first(os.path.join(out, "**", "summary_lifecycle_metrics.json"))
    if not path:
        return {}
    with open(path) as f:
        data = json.load(f)
    row = {}
    for ours, theirs in (("ttft", "time_to_first_token"), ("itl", "inter_token_latency")):
        dist = dig(data, "successes", "latency", theirs) or {}
        row[f"{ours}_mean_ms"] = num(dist.get("mean"), 1000)
        row[f"{ours}_p50_ms"] = num(dist.get("median", dist.get("p50")), 1000)
        row[f"{ours}_p99_ms"] = num(dist.get("p99"), 1000)
    row["requests_ok"] = dig(data, "successes", "count")
    row["requests_failed"] = dig(data, "failures", "count") or 0
    row["output_tokens_per_s"] = num(dig(data, "successes", "throughput", "output_tokens_per_sec"))
    return row


READERS = {"aiperf": read_aiperf, "guidellm": read_guidellm, "guidellm-responses": read_guidellm,
           "inference-perf": read_inference_perf}


def fmt(v, digits=0):
    return "—" if v is None else f"{v:,.{digits}f}"


def summarize(args):
    meta = dict(kv.split("=", 1) for kv in args.meta)
    rows, problems = [], []
    for spec in args.run:
        tool, out = spec.split("=", 1)
        row = {"tool": tool, **READERS[tool](out)}
        try:
            with open(os.path.join(out, "after.json")) as f:
                row.update(json.load(f))
        except (OSError, ValueError):
            row.update({"exit_code": None, "bookings_left": None})
        rows.append(row)
        if row.get("exit_code") != 0:
            problems.append(f"{tool} exited {row.get('exit_code')}")
        if not row.get("requests_ok"):
            problems.append(f"{tool} reported no completed request")
        if row.get("requests_failed"):
            problems.append(f"{tool} counted {row['requests_failed']} failed requests")
        if row.get("bookings_left") != 0:
            problems.append(f"{tool}: {row.get('bookings_left')} bookings left on the gateway")
    with open(args.out_json, "w") as f:
        json.dump({"meta": meta, "runs": rows, "problems": problems}, f, indent=2)
    lines = [
        "| tool | requests ok / failed / cut at the end | TTFT mean / p50 / p99 ms "
        "| ITL mean / p50 / p99 ms | output tok/s | bookings left |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ttft = " / ".join(fmt(r.get(f"ttft_{q}_ms"), 1) for q in ("mean", "p50", "p99"))
        itl = " / ".join(fmt(r.get(f"itl_{q}_ms"), 2) for q in ("mean", "p50", "p99"))
        counts = " / ".join(fmt(r.get(k, 0)) for k in ("requests_ok", "requests_failed", "requests_cut"))
        lines.append(f"| {r['tool']} | {counts} "
                     f"| {ttft} | {itl} | {fmt(r.get('output_tokens_per_s'))} "
                     f"| {fmt(r.get('bookings_left'))} |")
    lines.append("")
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += [f"- PROBLEM: {p}" for p in problems]
    with open(args.out_md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if problems else 0


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait-ready")
    w.add_argument("--url", required=True)
    w.add_argument("--workers", type=int, required=True)
    a = sub.add_parser("after-run")
    a.add_argument("--url", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--exit-code", type=int, required=True)
    s = sub.add_parser("summarize")
    s.add_argument("--run", action="append", default=[], help="TOOL=DIR")
    s.add_argument("--out-json", required=True)
    s.add_argument("--out-md", required=True)
    s.add_argument("--meta", action="append", default=[], help="KEY=VALUE")
    args = p.parse_args()
    return {"wait-ready": wait_ready, "after-run": after_run, "summarize": summarize}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
