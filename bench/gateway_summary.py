#!/usr/bin/env python3
"""The results of one bench/gateway.sh run: the JSON file and the markdown table.

Reads the client's per-run JSON files (`<server>-r<round>.json`, `overhead-gateway-<k>.json`,
`overhead-direct-<k>.json`) from --dir, writes --out, prints the table, and with --benchmarks FILE
replaces the text between `<!-- gateway:begin -->` and `<!-- gateway:end -->` in FILE.
`--results FILE` renders a results file written before (the same table, nothing recomputed).

Per server the table gives the median over rounds of each measure (the rounds' range beside
the TTFT ones); ratios are kvroute ÷ smg per round, then their median.
"""

import argparse
import datetime
import glob
import json
import os
import re
import statistics

NAMES = {
    "kvroute": "kvroute gateway",
    "smg": "smg `cache_aware`",
    "kvroute-rr": "kvroute gateway, round robin",
}


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, digits=0, unit=""):
    if v is None:
        return "—"
    return f"{v:,.{digits}f}{unit}"


def spread(values, digits=0):
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return ""
    return f" ({fmt(min(values), digits)}–{fmt(max(values), digits)})"


def mean_by_key(dicts):
    """The mean of each key over the dicts (a key missing from one counts as 0 there)."""
    keys = {k for d in dicts for k in d}
    n = max(1, len(dicts))
    means = {k: sum(d.get(k, 0) for d in dicts) / n for k in keys}
    return dict(sorted(means.items(), key=lambda kv: -kv[1]))


def per_server(runs):
    out = {}
    for name in NAMES:
        rs = [r for r in runs if r.get("server") == name and r["label"].startswith(name + "-r")]
        if not rs:
            continue
        g = lambda f: [f(r) for r in rs]  # noqa: E731
        out[name] = {
            "rounds": len(rs),
            "ttft_ms_p50": g(lambda r: r["ttft_ms"]["p50"]),
            "ttft_ms_p90": g(lambda r: r["ttft_ms"]["p90"]),
            "ttft_ms_p99": g(lambda r: r["ttft_ms"]["p99"]),
            "e2e_ms_p50": g(lambda r: r["e2e_ms"]["p50"]),
            "e2e_ms_p99": g(lambda r: r["e2e_ms"]["p99"]),
            "throughput_rps": g(lambda r: r["throughput_rps"]),
            "output_tokens_per_s": g(lambda r: r["output_tokens_per_s"]),
            "requests": g(lambda r: r["requests"]),
            "errors": g(lambda r: r["errors"]),
            "server_cpu_per_request_ms": g(lambda r: r.get("server_cpu_per_request_ms")),
            "bookings_left": g(lambda r: r.get("bookings_left")),
            "machine_steal_pct": g(lambda r: r.get("machine_steal_pct")),
            "client_cpus_busy_pct": g(lambda r: r.get("client_cpus_busy_pct")),
            "server_cpus_busy_pct": g(lambda r: r.get("server_cpus_busy_pct")),
            "other_cpu_pct": g(lambda r: r.get("other_cpu_pct")),
            "cpu_per_request_ms_by_thread": mean_by_key(
                g(lambda r: r.get("server_cpu_per_request_ms_by_thread") or {})
            ),
        }
    return out


def ratios(runs, num, den, field, q):
    by_round = {}
    for r in runs:
        m = re.fullmatch(r"(.+)-r(\d+)", r["label"])
        if m:
            by_round.setdefault(m.group(2), {})[m.group(1)] = r
    out = []
    for rnd in sorted(by_round, key=int):
        a, b = by_round[rnd].get(num), by_round[rnd].get(den)
        if not (a and b):
            continue
        va = a[field][q] if q else a.get(field)
        vb = b[field][q] if q else b.get(field)
        if va is not None and vb:
            out.append(va / vb)
    return out


def overhead_pair(gw, direct):
    pairs = {}
    for r in gw.get("per_request", []):
        if r.get("ok"):
            pairs[r["index"]] = [r["ttft_s"], None]
    for r in direct.get("per_request", []):
        if r.get("ok") and r["index"] in pairs:
            pairs[r["index"]][1] = r["ttft_s"]
    diffs = [1000 * (a - b) for a, b in pairs.values() if b is not None]
    g50, d50 = gw["ttft_ms"]["p50"], direct["ttft_ms"]["p50"]

    def engine_gap(run):
        # Client TTFT minus the engine's own (the mock reports it in its usage chunk): what sits
        # between client and engine, free of the engines' step timing.
        gaps = [1000 * (r["ttft_s"] - r["engine_ttft_s"]) for r in run.get("per_request", [])
                if r.get("ok") and r.get("engine_ttft_s") is not None and r.get("ttft_s") is not None]
        return statistics.median(gaps) if gaps else None

    eg, ed = engine_gap(gw), engine_gap(direct)
    return {
        "requests_gateway": gw["requests"],
        "requests_direct": direct["requests"],
        "errors_gateway": gw["errors"],
        "errors_direct": direct["errors"],
        "unrouted": sum(1 for u in gw.get("routes", []) if not u),
        "ttft_ms_p50_gateway": g50,
        "ttft_ms_p50_direct": d50,
        "overhead_ms_p50_difference": None if g50 is None or d50 is None else g50 - d50,
        "overhead_ms_paired_median": statistics.median(diffs) if diffs else None,
        "client_minus_engine_ttft_ms_p50_gateway": eg,
        "client_minus_engine_ttft_ms_p50_direct": ed,
        "overhead_ms_engine": None if eg is None or ed is None else eg - ed,
        "paired_requests": len(diffs),
        "server_cpu_per_request_ms": gw.get("server_cpu_per_request_ms"),
        "bookings_left": gw.get("bookings_left"),
        "other_cpu_pct": [gw.get("other_cpu_pct"), direct.get("other_cpu_pct")],
    }


def overhead(runs):
    by_label = {r["label"]: r for r in runs}
    pairs = []
    k = 1
    while f"overhead-gateway-{k}" in by_label and f"overhead-direct-{k}" in by_label:
        pairs.append(overhead_pair(by_label[f"overhead-gateway-{k}"], by_label[f"overhead-direct-{k}"]))
        k += 1
    if not pairs:
        return None
    first = by_label["overhead-gateway-1"]
    return {
        "concurrency": first["concurrency"],
        "prompt_tokens_mean": first["prompt_tokens_mean"],
        "max_tokens_mean": first["max_tokens_mean"],
        "pairs": pairs,
        "overhead_ms_p50_difference": median([p["overhead_ms_p50_difference"] for p in pairs]),
        "overhead_ms_paired_median": median([p["overhead_ms_paired_median"] for p in pairs]),
        "client_minus_engine_ttft_ms_p50_gateway": median(
            [p["client_minus_engine_ttft_ms_p50_gateway"] for p in pairs]),
        "client_minus_engine_ttft_ms_p50_direct": median(
            [p["client_minus_engine_ttft_ms_p50_direct"] for p in pairs]),
        "overhead_ms_engine": median([p["overhead_ms_engine"] for p in pairs]),
        "ttft_ms_p50_gateway": median([p["ttft_ms_p50_gateway"] for p in pairs]),
        "ttft_ms_p50_direct": median([p["ttft_ms_p50_direct"] for p in pairs]),
        "server_cpu_per_request_ms": median([p["server_cpu_per_request_ms"] for p in pairs]),
        "errors": sum(p["errors_gateway"] + p["errors_direct"] for p in pairs),
        "bookings_left": max((p["bookings_left"] or 0) for p in pairs),
    }


def table(summary):
    s = summary["servers"]
    lines = [
        "| server | rounds | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | E2E p50 ms | E2E p99 ms "
        "| req/s | output tok/s | errors | server CPU per request | bookings left "
        "| busy % server / client CPU | other work % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in s.items():
        left = [x for x in v["bookings_left"] if x is not None]
        lines.append(
            f"| {NAMES[name]} | {v['rounds']} "
            f"| {fmt(median(v['ttft_ms_p50']))}{spread(v['ttft_ms_p50'])} "
            f"| {fmt(median(v['ttft_ms_p90']))}{spread(v['ttft_ms_p90'])} "
            f"| {fmt(median(v['ttft_ms_p99']))}{spread(v['ttft_ms_p99'])} "
            f"| {fmt(median(v['e2e_ms_p50']))} | {fmt(median(v['e2e_ms_p99']))} "
            f"| {fmt(median(v['throughput_rps']), 1)} | {fmt(median(v['output_tokens_per_s']))} "
            f"| {sum(v['errors'])} of {sum(v['requests'])} "
            f"| {fmt(median(v['server_cpu_per_request_ms']), 2, ' ms')} "
            f"| {fmt(max(left)) if left else '—'} "
            f"| {fmt(median(v['server_cpus_busy_pct']))} / {fmt(median(v['client_cpus_busy_pct']))} "
            f"| {fmt(median(v['other_cpu_pct']), 1)} |"
        )
    r = summary["ratios"]
    notes = []
    for name, v in s.items():
        threads = list(v["cpu_per_request_ms_by_thread"].items())[:4]
        if threads:
            notes.append(
                f"{NAMES[name]} CPU per request by thread (mean of rounds): "
                + ", ".join(f"`{k}` {fmt(ms, 2)} ms" for k, ms in threads)
                + "."
            )
    if r.get("ttft_p90_kvroute_over_smg"):
        notes.append(
            f"kvroute ÷ smg (median of rounds): TTFT p90 {fmt(median(r['ttft_p90_kvroute_over_smg']), 2)}, "
            f"p99 {fmt(median(r['ttft_p99_kvroute_over_smg']), 2)}, server CPU per request "
            f"{fmt(median(r['cpu_per_request_kvroute_over_smg']), 2)}."
        )
    o = summary.get("overhead")
    if o:
        per_pair = ", ".join(fmt(p["overhead_ms_p50_difference"], 2) for p in o["pairs"])
        notes.append(
            f"Gateway overhead at {o['concurrency']} streams ({fmt(o['prompt_tokens_mean'])}-token "
            f"prompts, {fmt(o['max_tokens_mean'])} output tokens), medians of {len(o['pairs'])} "
            f"pairs: TTFT p50 {fmt(o['ttft_ms_p50_gateway'], 2)} ms through the gateway, "
            f"{fmt(o['ttft_ms_p50_direct'], 2)} ms straight to the same engines: overhead "
            f"**{fmt(o['overhead_ms_p50_difference'], 2)} ms** (pairs: {per_pair}; median "
            f"per-request difference {fmt(o['overhead_ms_paired_median'], 2)} ms); gateway CPU "
            f"{fmt(o['server_cpu_per_request_ms'], 3)} ms per request; {o['errors']} errors; "
            f"bookings left {fmt(o['bookings_left'])}."
        )
        if o.get("overhead_ms_engine") is not None:
            notes.append(
                "Gateway overhead by the engine's own first-token time (the mock reports it in "
                "its usage chunk): client TTFT − engine TTFT, p50, "
                f"{fmt(o['client_minus_engine_ttft_ms_p50_gateway'], 2)} ms through the gateway, "
                f"{fmt(o['client_minus_engine_ttft_ms_p50_direct'], 2)} ms straight to the "
                f"engines (the client and loopback alone): the gateway adds "
                f"**{fmt(o['overhead_ms_engine'], 2)} ms**."
            )
    notes.append(targets(summary))
    return "\n".join(lines) + "\n\n" + "\n\n".join(n for n in notes if n)


def targets(summary):
    """The gateway's targets (against smg), each met, not met, or not measured in this run."""
    s, r, o = summary["servers"], summary["ratios"], summary.get("overhead")

    def verdict(value, ok, shown):
        if value is None:
            return "not measured"
        return f"{'met' if ok(value) else '**not met**'} ({shown(value)})"

    kv = s.get("kvroute")
    errors = None if not kv else sum(kv["errors"]) + (o["errors"] if o else 0)
    left = [x for x in (kv["bookings_left"] if kv else []) if x is not None]
    if o and o.get("bookings_left") is not None:
        left.append(o["bookings_left"])
    items = [
        ("TTFT p90 ≤ 0.8 × smg's", median(r["ttft_p90_kvroute_over_smg"]), lambda v: v <= 0.8,
         lambda v: f"{v:.2f}"),
        ("TTFT p99 ≤ 0.8 × smg's", median(r["ttft_p99_kvroute_over_smg"]), lambda v: v <= 0.8,
         lambda v: f"{v:.2f}"),
        ("0 errors", errors, lambda v: v == 0, lambda v: f"{v}"),
        ("no booking left", max(left) if left else None, lambda v: v == 0, lambda v: f"{v:g}"),
        ("overhead p50 ≤ 1 ms (client − engine TTFT, less the client's own)",
         o and (o.get("overhead_ms_engine") if o.get("overhead_ms_engine") is not None
                else o["overhead_ms_p50_difference"]), lambda v: v <= 1,
         lambda v: f"{v:.2f} ms"),
        ("CPU per request ≤ ½ of smg's", median(r["cpu_per_request_kvroute_over_smg"]),
         lambda v: v <= 0.5, lambda v: f"{v:.2f}×"),
    ]
    return "Targets (the gateway against smg): " + "; ".join(
        f"{name}: {verdict(value, ok, shown)}" for name, value, ok, shown in items
    ) + "."


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", help="the runs' JSON files")
    p.add_argument("--out", help="the results file to write")
    p.add_argument("--results", help="render an existing results file instead (no --dir, --out)")
    p.add_argument("--machine", default="")
    p.add_argument("--cpu-model", default="")
    p.add_argument("--commit", default="")
    p.add_argument("--kvroute-bin", default="")
    p.add_argument("--smg-version", default="")
    p.add_argument("--config", default="")
    p.add_argument("--benchmarks", help="BENCHMARKS.md to update between the gateway markers")
    args = p.parse_args()
    if args.results:
        result = json.load(open(args.results))
        render(result, args.results, args.benchmarks)
        return
    if not (args.dir and args.out):
        p.error("--dir and --out are required without --results")

    runs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(args.dir, "*.json")))]
    runs = [r for r in runs if "label" in r]
    summary = {
        "servers": per_server(runs),
        "ratios": {
            "ttft_p90_kvroute_over_smg": ratios(runs, "kvroute", "smg", "ttft_ms", "p90"),
            "ttft_p99_kvroute_over_smg": ratios(runs, "kvroute", "smg", "ttft_ms", "p99"),
            "cpu_per_request_kvroute_over_smg": ratios(
                runs, "kvroute", "smg", "server_cpu_per_request_ms", None
            ),
        },
        "overhead": overhead(runs),
    }
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {
        "date": now.strftime("%Y-%m-%d %H:%M UTC"),
        "commit": args.commit,
        "kvroute_bin": args.kvroute_bin,
        "smg_version": args.smg_version,
        "machine": args.machine,
        "cpu_model": args.cpu_model,
        "config": dict(kv.split("=", 1) for kv in args.config.split() if "=" in kv),
        "summary": summary,
        # Per-request records stay out of the results file (thousands of lines).
        "runs": [{k: v for k, v in r.items() if k not in ("per_request", "routes")} for r in runs],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    render(result, args.out, args.benchmarks)


def render(result, path, benchmarks):
    """Prints the run's text and puts it between the gateway markers of `benchmarks`."""
    name = os.path.basename(path)
    config = " ".join(f"{k}={v}" for k, v in result["config"].items())
    text = (
        f"Run of {result['date']} at commit `{result['commit']}` on {result['cpu_model']} "
        f"({result['machine']}): kvroute `{result['kvroute_bin']}`, smg {result['smg_version']}; "
        f"{config}. Raw results: [bench/results/{name}](bench/results/{name}).\n\n"
        + table(result["summary"])
    )
    print(text)
    if benchmarks:
        doc = open(benchmarks).read()
        begin, end = "<!-- gateway:begin -->", "<!-- gateway:end -->"
        if begin in doc and end in doc:
            head, rest = doc.split(begin, 1)
            _, tail = rest.split(end, 1)
            with open(benchmarks, "w") as f:
                f.write(head + begin + "\n" + text + "\n" + end + tail)
        else:
            print(f"({benchmarks} has no gateway markers: left alone)")


if __name__ == "__main__":
    main()
