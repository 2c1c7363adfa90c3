#!/usr/bin/env python3
"""Helpers of bench/pd_live.sh (standard library only; aiperf's export is read as
bench/gateway_aiperf.py reads it).

  wait-models --url URL --model NAME
      Waits (60 s at most) until GET URL/v1/models lists NAME.
  collect --out DIR --exit-code N --cpu T0,T1 --bookings-left N|null --requests N
          --overlap JSON --protocol P --engine ROLE=URL ...
      Reads each engine's counters (GET /metrics: requests, prompt and cached tokens) and
      writes DIR/server.json.
  summarize --run NAME=DIR ... --out-json F --out-md F [--meta KEY=VALUE ...]
      One JSON and one markdown table of the runs.
"""

import argparse
import json
import os
import re
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gateway_aiperf import fmt, read_run  # noqa: E402

COUNTERS = {
    "vllm:request_success_total": "requests",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prefix_cache_hits_total": "cached_tokens",
}


def wait_models(args):
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(args.url + "/v1/models", timeout=2) as r:
                body = json.loads(r.read())
            if any(m.get("id") == args.model for m in body.get("data", [])):
                return 0
        except (OSError, ValueError):
            pass
        time.sleep(0.3)
    print(f"{args.url} did not list model {args.model} within 60 s", file=sys.stderr)
    return 1


def engine_counters(url):
    out = {v: None for v in COUNTERS.values()}
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError as e:
        out["error"] = str(e)
        return out
    for line in text.splitlines():
        m = re.match(r"([a-z_:]+)\{[^}]*\} (\S+)$", line)
        if m and m.group(1) in COUNTERS:
            out[COUNTERS[m.group(1)]] = (out[COUNTERS[m.group(1)]] or 0) + float(m.group(2))
    return out


def collect(args):
    os.makedirs(args.out, exist_ok=True)
    tick = os.sysconf("SC_CLK_TCK")
    c0, c1 = (float(x) for x in args.cpu.split(","))
    cpu_s = (c1 - c0) / tick
    engines = []
    for spec in args.engine:
        role, _, url = spec.partition("=")
        engines.append({"role": role, "url": url, **engine_counters(url)})
    doc = {
        "aiperf_exit_code": args.exit_code,
        "protocol": args.protocol,
        "server_cpu_s": cpu_s,
        "server_cpu_per_request_ms": 1000 * cpu_s / max(1, args.requests),
        "bookings_left": None if args.bookings_left == "null" else float(args.bookings_left),
        "kvroute_selection_overlap_tokens": json.loads(args.overlap),
        "engines": engines,
    }
    with open(os.path.join(args.out, "server.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return 0


def pd_figures(engines):
    """Spread over the prefill engines, their prefix-cache hits, and bypasses."""
    pre = [e for e in engines if e["role"] == "prefill"]
    dec = [e for e in engines if e["role"] == "decode"]
    n = lambda es, k: sum(e.get(k) or 0 for e in es)  # noqa: E731
    prefill_requests = [int(e.get("requests") or 0) for e in pre]
    hits = n(pre, "cached_tokens") / n(pre, "prompt_tokens") if n(pre, "prompt_tokens") else None
    return {
        "prefill_requests": prefill_requests,
        "decode_requests": [int(e.get("requests") or 0) for e in dec],
        "prefill_cache_hit_share": hits,
        # Each request with a prefill leg runs one there; a bypass runs on a decode engine only.
        "bypasses": int(n(dec, "requests") - n(pre, "requests")),
    }


LABELS = {
    "kvroute-sglang": "kvroute gateway, SGLang",
    "smg": "smg `--pd-disaggregation`",
    "kvroute-vllm": "kvroute gateway, vLLM",
    "vllm-router": "vllm-router `--vllm-pd-disaggregation`",
}
RIVALS = {"kvroute-sglang": ["smg"], "kvroute-vllm": ["vllm-router"]}


def summarize(args):
    runs = []
    for spec in args.run:
        name, _, d = spec.partition("=")
        path = os.path.join(d, "profile_export_aiperf.json")
        extra = os.path.join(d, "server.json")
        r = {"server": name}
        if os.path.exists(extra):
            with open(extra) as f:
                r.update(json.load(f))
            r.update(pd_figures(r.get("engines", [])))
        if os.path.exists(path):
            r.update(read_run(path))
        else:
            r["missing"] = path
        runs.append(r)
    meta = dict(kv.partition("=")[::2] for kv in args.meta)
    with open(args.out_json, "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1)
    lines = [
        "| front | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | request latency p99 ms "
        "| ok / failed | prefill requests per worker | prefill cache hits | bypasses "
        "| bookings left |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        name = LABELS.get(r["server"], r["server"])
        spread = " / ".join(str(x) for x in r.get("prefill_requests", [])) or "—"
        hits = r.get("prefill_cache_hit_share")
        left = r.get("bookings_left")
        if "missing" in r:
            lines.append(f"| {name} | no aiperf result | | | | | {spread} | | | |")
            continue
        lines.append(
            f"| {name} | {fmt(r['time_to_first_token_p50_ms'])} "
            f"| {fmt(r['time_to_first_token_p99_ms'])} "
            f"| {fmt(r['inter_token_latency_p99_ms'], 2)} "
            f"| {fmt(r['request_latency_p99_ms'])} "
            f"| {fmt(r['requests_ok'])} / {fmt(r['requests_failed'])} "
            f"| {spread} | {'—' if hits is None else f'{100 * hits:.1f} %'} "
            f"| {r.get('bypasses', '—')} | {'—' if left is None else fmt(left)} |"
        )
    by = {r["server"]: r for r in runs if "missing" not in r}
    notes = []
    rivals = [by[o] for o in ("smg", "vllm-router") if o in by]
    best = min((o for o in rivals if o["time_to_first_token_p99_ms"]),
               key=lambda o: o["time_to_first_token_p99_ms"], default=None)
    for kv_name, others in RIVALS.items():
        kv = by.get(kv_name)
        if not kv:
            continue
        for o in [by[x] for x in others if x in by] + ([best] if best else []):
            parts = []
            for tag, label, limit in (("time_to_first_token", "TTFT p99", 0.8),
                                      ("inter_token_latency", "ITL p99", 1.0)):
                a, b = kv[f"{tag}_p99_ms"], o[f"{tag}_p99_ms"]
                if a is not None and b:
                    verdict = "met" if a <= limit * b else "**not met**"
                    parts.append(f"{label} {a / b:.2f}× (target ≤ {limit}: {verdict})")
            if parts:
                who = LABELS[o["server"]] + (" (the better rival)" if o is best else "")
                notes.append(f"{LABELS[kv_name]} ÷ {who}: " + ", ".join(parts) + ".")
    head = ", ".join(f"{k} {v}" for k, v in meta.items() if k not in ("config", "policies"))
    md = f"aiperf run: {head}. {meta.get('config', '')}. Policies: {meta.get('policies', '')}.\n\n"
    md += "\n".join(lines) + "\n"
    if notes:
        md += "\n" + "\n".join(dict.fromkeys(notes)) + "\n"
    for r in runs:
        if r.get("error_summary"):
            md += f"\n{LABELS.get(r['server'], r['server'])} errors: {json.dumps(r['error_summary'])}\n"
    with open(args.out_md, "w") as f:
        f.write(md)
    print(md)
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait-models")
    w.add_argument("--url", required=True)
    w.add_argument("--model", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--out", required=True)
    c.add_argument("--exit-code", type=int, required=True)
    c.add_argument("--cpu", required=True)
    c.add_argument("--bookings-left", required=True)
    c.add_argument("--requests", type=int, required=True)
    c.add_argument("--overlap", default="{}")
    c.add_argument("--protocol", required=True)
    c.add_argument("--engine", action="append", default=[], help="ROLE=URL")
    s = sub.add_parser("summarize")
    s.add_argument("--run", action="append", default=[], help="NAME=DIR (aiperf's artifact dir)")
    s.add_argument("--out-json", required=True)
    s.add_argument("--out-md", required=True)
    s.add_argument("--meta", action="append", default=[], help="KEY=VALUE")
    args = p.parse_args()
    return {"wait-models": wait_models, "collect": collect, "summarize": summarize}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
