#!/usr/bin/env python3
"""Turns the load generator's per-run JSON files into the side-by-side table (stdlib only).

    summarize.py --dir RUNS --rounds N --out results/DATE.json [--benchmarks FILE]
        one run: prints its table and writes its results JSON (--benchmarks appends the table
        to FILE);
    summarize.py --history BENCHMARKS.md [--results bench/results]
        rewrites FILE's headline (the latest results JSON) and history (one row per results
        JSON, the newest HISTORY_ROWS) between their <!-- headline:begin/end --> and <!-- history:begin/end --> markers.
"""
import argparse, glob, json, os, re, statistics, sys, datetime

p = argparse.ArgumentParser()
p.add_argument("--dir")
p.add_argument("--rounds", type=int)
p.add_argument("--out")
p.add_argument("--machine", default="")
p.add_argument("--cpu-model", default="")
p.add_argument("--commit", default="")
p.add_argument("--dynamo-version", default="")
p.add_argument("--benchmarks")
p.add_argument("--history", metavar="FILE")
p.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
a = p.parse_args()


def fmt_ratio(x, unit="×"):
    return f"{x:.2f}{unit}" if x is not None else "—"


def storm_kind(entry):
    """'alone', 'remote' or 'colocated' for an event-storm entry of a results JSON. The first
    runs recorded one storm, with the fake engines at nice 0 (co-located), and no label."""
    engines = entry.get("engines", "co-located")
    if "alone" in engines:
        return "alone"
    return "colocated" if "co-located" in engines else "remote"


def load_results(directory):
    """Every side-by-side results JSON in `directory` (named by its start, `2026-…json`; not
    bench/gateway.sh's `gateway-…json`), oldest first, as (file name, report)."""
    out = []
    for f in sorted(glob.glob(os.path.join(directory, "[0-9]*.json"))):
        with open(f) as fh:
            out.append((os.path.basename(f), json.load(fh)))
    return out


def run_stamp(name):
    """A results file's name (the run's start, UTC) as `YYYY-MM-DD HH:MM`."""
    m = re.match(r"(\d{4}-\d{2}-\d{2})T(\d{2})-(\d{2})", name)
    return f"{m.group(1)} {m.group(2)}:{m.group(3)}" if m else name


def headline_lines(name, r, link):
    """The headline: the latest run's medians, storm pairs and targets."""
    s, rows = r.get("summary", {}), r.get("rows", [])
    storms = r.get("event_storm", [])
    storms = [storms] if isinstance(storms, dict) else storms
    w = r.get("workload", {})
    lines = [f"Run of {run_stamp(name)} UTC at commit `{r.get('commit', '?')}` on "
             f"{r.get('cpu_model') or 'a CPU it did not record'} ({r.get('machine', '')}), Dynamo "
             f"{r.get('dynamo_version', '?')}, {w.get('workers')} workers, {w.get('concurrency')} "
             f"connections, mean prompt {w.get('mean_prompt_tokens')} tokens. Raw results: "
             f"[{link}]({link}).", "",
             "| measure | kvroute / Dynamo (median) | rounds | p99 ratio (median) | server CPU per request |",
             "|---|---:|---|---:|---:|"]
    names = {"select": "/select throughput", "cycle_isolated":
             "cycle throughput, load generator on its own core (**isolated: counts**)",
             "cycle": "cycle throughput, load generator sharing the servers' cores (information)"}
    for mode in ("select", "cycle_isolated", "cycle"):
        if mode not in s:
            continue
        t = s[mode]
        per_round = ", ".join(f"{x['throughput_ratio']:.2f}" for x in rows if x["mode"] == mode)
        cpu = f"{t['median_cpu_ratio']:.2f}× less" if "median_cpu_ratio" in t else "—"
        lines.append(f"| {names[mode]} | **{t['median_throughput_ratio']:.2f}×** | {per_round} | "
                     f"{t['median_p99_ratio']:.2f} | {cpu} |")
    storm_names = {"alone": "load generator alone (no subscriber; the floor, information)",
                   "remote": "remote-like engines (SCHED_IDLE)", "colocated": "co-located engines (nice 0)"}
    for e in storms:
        applied = e.get("stored_blocks_applied_per_s")
        applied = f", {applied:,.0f} stored blocks applied/s" if applied else ""
        lines.append(f"| event storm, kvroute `/select` p99 rise: {storm_names[storm_kind(e)]} | "
                     f"**{e['ratio']:.2f}×** | p99 {e['quiet_p99_us']:,} → {e['storm_p99_us']:,} µs{applied} | | |")
    notes = []
    lag = r.get("kvroute_index_lag")
    if lag:
        shares = [100 * x["after_run"] / (x["during_run"] + x["after_run"])
                  for x in lag if x["during_run"] + x["after_run"]]
        if shares:
            notes.append(f"kvroute's index in the shared cycle rounds: {min(shares):.1f}–{max(shares):.1f} % of "
                         f"a round's stored blocks applied after the round ended, settled within "
                         f"{max(x['settle_s'] for x in lag):.1f} s.")
    split = r.get("cycle_cpu_split")
    if split and len(split) == 2:
        d, k = split["dynamo"], split["kvroute"]
        notes.append(f"CPU per shared-core cycle (medians): Dynamo's server {d['server_user_us']:.0f} µs user + "
                     f"{d['server_system_us']:.0f} µs system, kvroute's {k['server_user_us']:.0f} + "
                     f"{k['server_system_us']:.0f}; the load generator {d['loadgen_us']:.0f} µs with Dynamo, "
                     f"{k['loadgen_us']:.0f} with kvroute.")
    if r.get("targets"):
        notes.append("Targets (kvroute against Dynamo): " + "; ".join(
            f"{t['target']}: {'met' if t['met'] else '**not met**'} ({t['value']})" for t in r["targets"]) + ".")
    if notes:
        lines += ["", " ".join(notes)]
    return lines


# Rows of the history table: the newest runs, so that BENCHMARKS.md stays a short reference; the
# older runs are named by a count and their folder.
HISTORY_ROWS = 8


def history_lines(results, rel):
    """One row per results JSON, newest first, at most HISTORY_ROWS of them."""
    lines = ["| run (UTC) | commit | rounds | /select | /select p99 ratio | cycle, isolated | cycle, shared "
             "| storm p99 rise: remote-like | co-located | max steal % |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in list(reversed(results))[:HISTORY_ROWS]:
        s, rows = r.get("summary", {}), r.get("rows", [])
        storms = r.get("event_storm", [])
        storms = [storms] if isinstance(storms, dict) else storms
        rise = {storm_kind(e): e["ratio"] for e in storms}
        med = lambda m, k="median_throughput_ratio": s.get(m, {}).get(k)
        steal = [x["max_steal_pct"] for x in rows if "max_steal_pct" in x]
        commit = r.get("commit", "?")
        if "not recorded" in r.get("commit_source", ""):
            commit += "*"
        lines.append(f"| [{run_stamp(name)}]({rel}/{name}) | `{commit}` | "
                     f"{len({x['round'] for x in rows})} | {fmt_ratio(med('select'))} | "
                     f"{fmt_ratio(med('select', 'median_p99_ratio'), '')} | {fmt_ratio(med('cycle_isolated'))} | "
                     f"{fmt_ratio(med('cycle'))} | {fmt_ratio(rise.get('remote'))} | "
                     f"{fmt_ratio(rise.get('colocated'))} | {f'{max(steal):.0f}' if steal else '—'} |")
    older = len(results) - HISTORY_ROWS
    if older > 0:
        lines += ["", f"{older} older runs: [bench/results/]({rel}/)."]
    return lines


def replace_between(text, marker, body):
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        sys.exit(f"summarize.py: {begin} ... {end} not found in {a.history}")
    return text[:i + len(begin)] + "\n" + "\n".join(body) + "\n" + text[j:]


if a.history:
    results = load_results(a.results)
    if not results:
        sys.exit(f"summarize.py: no results JSON in {a.results}")
    rel = os.path.relpath(os.path.abspath(a.results), os.path.dirname(os.path.abspath(a.history)))
    with open(a.history) as f:
        text = f.read()
    name, latest = results[-1]
    text = replace_between(text, "headline", headline_lines(name, latest, f"{rel}/{name}"))
    text = replace_between(text, "history", history_lines(results, rel))
    with open(a.history, "w") as f:
        f.write(text)
    print(f"{a.history}: headline from {name}, history of {len(results)} runs")
    sys.exit(0)
if a.dir is None or a.rounds is None or a.out is None:
    p.error("--dir, --rounds and --out are required (or --history FILE)")

runs = {}
for f in glob.glob(os.path.join(a.dir, "*.json")):
    r = json.load(open(f))
    runs[r["label"]] = r

def cpu_us(run, route, seconds=None):
    """CPU µs per request (per cycle in cycle mode) of `seconds` over the run, by default the
    server's whole CPU time; None when the run did not record it."""
    if seconds is None:
        seconds = run.get("server_cpu_s")
    done = route["rps"] * run.get("duration_s", 0)
    return 1e6 * seconds / done if seconds is not None and done else None


# Measures: key → (the load generator's mode, the round labels' prefix, the table's row name,
# its median's name). `cycle_isolated`: the cycle rounds with the load generator on cores of its
# own (side_by_side.sh, ISOLATED=1).
MEASURES = {"select": ("select", "r", "/select", "/select"),
            "cycle": ("cycle", "r", "select→reserve→prefill→free cycle", "cycle"),
            "cycle_isolated": ("cycle", "riso", "cycle, load generator on its own cores", "cycle, isolated")}
rows, ratios, cpu_ratios = [], {}, {}
for mode, (lg_mode, prefix, _, _) in MEASURES.items():
    for rnd in range(1, a.rounds + 1):
        d, k = runs.get(f"dynamo-{lg_mode}-{prefix}{rnd}"), runs.get(f"kvroute-{lg_mode}-{prefix}{rnd}")
        if not d or not k:
            continue
        metric = "select" if mode == "select" else None
        dv = d["routes"]["select"] if metric else d["cycles"]
        kv = k["routes"]["select"] if metric else k["cycles"]
        thr = kv["rps"] / dv["rps"] if dv["rps"] else float("inf")
        p99 = kv["p99_us"] / dv["p99_us"] if dv["p99_us"] else 0.0
        ratios.setdefault(mode, []).append((thr, p99))
        dc, kc = cpu_us(d, dv), cpu_us(k, kv)
        if dc and kc:
            cpu_ratios.setdefault(mode, []).append(dc / kc)
        steal = max(d.get("machine_steal_pct", 0), k.get("machine_steal_pct", 0))
        rows.append({
            "mode": mode, "round": rnd,
            "dynamo": {"rps": dv["rps"], "p50_us": dv["p50_us"], "p99_us": dv["p99_us"], "errors": d["errors"]},
            "kvroute": {"rps": kv["rps"], "p50_us": kv["p50_us"], "p99_us": kv["p99_us"], "errors": k["errors"]},
            "throughput_ratio": thr, "p99_ratio": p99,
            "dynamo_cpu_us": dc, "kvroute_cpu_us": kc, "max_steal_pct": steal,
        })

storm_rows = []
# Each storm run against the quiet run just before it (older results have one quiet run).
# A pair whose engines publish to no subscriber measures the load generator alone: what the
# storm costs the machine outside the server (informational, not a target).
for label, quiet_label, engines, is_target in (
        ("storm-unsubscribed", "quiet-unsubscribed", "none: load generator alone (engines at SCHED_IDLE publish to no subscriber)", False),
        ("storm", "quiet", "remote (fake engines at {})", True),
        ("storm-colocated", "quiet-colocated", "co-located (fake engines at nice 0)", True)):
    storm = runs.get(f"kvroute-select-r{label}")
    quiet = runs.get(f"kvroute-select-r{quiet_label}") or runs.get("kvroute-select-rquiet")
    if not (storm and quiet):
        continue
    engines = engines.format("SCHED_IDLE" if storm.get("engine_idle") else f"nice {storm.get('engine_nice', 19)}")
    sp, qp = storm["routes"]["select"]["p99_us"], quiet["routes"]["select"]["p99_us"]
    storm_rows.append({"engines": engines, "target": is_target, "quiet_p99_us": qp, "storm_p99_us": sp,
                       "ratio": sp / qp if qp else 0.0,
                       "quiet_p50_us": quiet["routes"]["select"]["p50_us"],
                       "storm_p50_us": storm["routes"]["select"]["p50_us"],
                       "quiet_rps": quiet["routes"]["select"]["rps"],
                       "storm_rps": storm["routes"]["select"]["rps"],
                       "storm_prompts_published": storm.get("event_storm_prompts"),
                       "stored_blocks_applied_per_s": storm.get("stored_blocks_applied_per_s")})
summary = {m: {"median_throughput_ratio": statistics.median(x[0] for x in v),
               "median_p99_ratio": statistics.median(x[1] for x in v)} for m, v in ratios.items()}
for m, v in cpu_ratios.items():
    summary[m]["median_cpu_ratio"] = statistics.median(v)
report = {
    "date": datetime.datetime.utcnow().isoformat() + "Z",
    "commit": a.commit, "commit_source": "recorded by side_by_side.sh" if a.commit else "", "cpu_model": a.cpu_model,
    "machine": a.machine, "dynamo_version": a.dynamo_version,
    "workload": {k: runs[next(iter(runs))].get(k) for k in ("workers", "concurrency", "mean_prompt_tokens", "prompts")} if runs else {},
    "rows": rows, "summary": summary, "event_storm": storm_rows, "runs": runs,
}

lines = [f"### {report['date'][:19]} — {a.machine}, Dynamo {a.dynamo_version}, "
         f"W={report['workload'].get('workers')} C={report['workload'].get('concurrency')}, "
         f"mean prompt {report['workload'].get('mean_prompt_tokens')} tokens", "",
         "| measure | round | Dynamo req/s | kvroute req/s | ratio | Dynamo p50/p99 µs | kvroute p50/p99 µs | p99 ratio | server CPU µs/req Dynamo / kvroute | steal % |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
for r in rows:
    name = MEASURES[r["mode"]][2]
    d, k = r["dynamo"], r["kvroute"]
    lines.append(f"| {name} | {r['round']} | {d['rps']:.0f} | {k['rps']:.0f} | {r['throughput_ratio']:.2f}× | "
                 f"{d['p50_us']}/{d['p99_us']} | {k['p50_us']}/{k['p99_us']} | {r['p99_ratio']:.2f} | "
                 + (f"{r['dynamo_cpu_us']:.0f} / {r['kvroute_cpu_us']:.0f} | " if r["kvroute_cpu_us"] and r["dynamo_cpu_us"] else "n/a | ")
                 + f"{r['max_steal_pct']:.0f} |")
for m, s in summary.items():
    name = MEASURES[m][3]
    cpu = f"**{s['median_cpu_ratio']:.2f}× less**" if "median_cpu_ratio" in s else ""
    lines.append(f"| **{name} median** | | | | **{s['median_throughput_ratio']:.2f}×** | | | **{s['median_p99_ratio']:.2f}** | {cpu} | |")
if storm_rows:
    lines += ["", "Event storm (kvroute `/select` while every fake engine publishes random prompts as fast as it can):", "",
              "| engines | prompts published | stored blocks applied/s | /select p50 µs quiet → storm | p99 µs quiet → storm | p99 rise | req/s quiet → storm |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in storm_rows:
        applied = r["stored_blocks_applied_per_s"]
        applied = f"{applied:,.0f}" if applied is not None else "n/a"
        lines.append(f"| {r['engines']} | {r['storm_prompts_published']} | {applied} | "
                     f"{r['quiet_p50_us']} → {r['storm_p50_us']} | {r['quiet_p99_us']} → {r['storm_p99_us']} | "
                     f"**{r['ratio']:.2f}×** | {r['quiet_rps']:.0f} → {r['storm_rps']:.0f} |")
# kvroute's index lag in its cycle runs: events of the run applied only after it ended.
lag = [(rnd, runs[f"kvroute-cycle-r{rnd}"]) for rnd in range(1, a.rounds + 1)
       if "stored_applied_after_run" in runs.get(f"kvroute-cycle-r{rnd}", {})]
if lag:
    report["kvroute_index_lag"] = [{"round": rnd, "during_run": r["stored_applied_during_run"],
                                    "after_run": r["stored_applied_after_run"],
                                    "settle_s": r["index_settle_s"]} for rnd, r in lag]
    parts = []
    for rnd, r in lag:
        total = r["stored_applied_during_run"] + r["stored_applied_after_run"]
        share = 100 * r["stored_applied_after_run"] / total if total else 0.0
        parts.append(f"round {rnd}: {r['stored_applied_after_run']:,.0f} of {total:,.0f} "
                     f"({share:.1f} %), settled in {r['index_settle_s']:.1f} s")
    lines += ["", "kvroute's index in its cycle runs, stored blocks applied after the run ended: "
              + "; ".join(parts) + "."]
# The ingest-free cycle runs (INGEST_FREE=1): each server's cycle without KV-event ingest, against
# the medians of its measured rounds.
free = {}
for name in ("dynamo", "kvroute"):
    run = runs.get(f"{name}-cycle-ringest-free")
    measured = [r[name] for r in rows if r["mode"] == "cycle"]
    cpu = [r[f"{name}_cpu_us"] for r in rows if r["mode"] == "cycle" and r[f"{name}_cpu_us"]]
    free_cpu = cpu_us(run, run["cycles"]) if run else None
    if not measured or not cpu or free_cpu is None:
        continue
    free[name] = {"rps": statistics.median(m["rps"] for m in measured),
                  "cpu_us": statistics.median(cpu),
                  "ingest_free_rps": run["cycles"]["rps"], "ingest_free_cpu_us": free_cpu}
if free:
    report["ingest_free_cycle"] = free
    lines.append("")
    for name, f in free.items():
        lines.append(f"Ingest-free cycle, {name}: {f['rps']:,.0f} cycles/s ({f['cpu_us']:.0f} µs server CPU "
                     f"per cycle; median of the rounds) → {f['ingest_free_rps']:,.0f} without ingest "
                     f"({f['ingest_free_cpu_us']:.0f} µs).")
    if len(free) == 2:
        k, y = free["kvroute"], free["dynamo"]
        lines.append(f"Cycle ratio kvroute/Dynamo: {k['rps'] / y['rps']:.2f}× with ingest (medians), "
                     f"{k['ingest_free_rps'] / y['ingest_free_rps']:.2f}× without; ingest's server CPU "
                     f"per cycle: Dynamo {y['cpu_us'] - y['ingest_free_cpu_us']:.0f} µs, "
                     f"kvroute {k['cpu_us'] - k['ingest_free_cpu_us']:.0f} µs.")
# Where a cycle's CPU goes (runs that recorded it): per server, the medians over the measured
# rounds of its user and system CPU and of the load generator's (clients and fake engines) per
# cycle. The two cores are shared, so a cycle run's rate is about (busy cores) / (server +
# load generator CPU per cycle), which says what kvroute's server would need per cycle for 3×.
split = {}
for name in ("dynamo", "kvroute"):
    per = []
    for rnd in range(1, a.rounds + 1):
        run = runs.get(f"{name}-cycle-r{rnd}", {})
        lg = run.get("loadgen_cpu")
        if "server_user_s" in run and lg:
            parts = [cpu_us(run, run["cycles"], s) for s in
                     (run["server_user_s"], run["server_system_s"], lg["user_s"] + lg["system_s"])]
            if None not in parts:
                per.append(parts)
    if per:
        split[name] = {k: statistics.median(p[i] for p in per)
                       for i, k in enumerate(("server_user_us", "server_system_us", "loadgen_us"))}
if split:
    report["cycle_cpu_split"] = split
    lines.append("")
    for name, c in split.items():
        lines.append(f"Cycle CPU per cycle, {name} (medians of the rounds): server {c['server_user_us']:.0f} µs "
                     f"user + {c['server_system_us']:.0f} µs system, load generator {c['loadgen_us']:.0f} µs.")
    if len(split) == 2:
        d, k = split["dynamo"], split["kvroute"]
        need = (d["server_user_us"] + d["server_system_us"] + d["loadgen_us"]) / 3 - k["loadgen_us"]
        lines.append(f"At these costs, with the load generator sharing the servers' cores, 3× Dynamo's "
                     f"cycle rate needs kvroute's server at ≤ {need:.0f} µs "
                     f"of CPU per cycle (it used {k['server_user_us'] + k['server_system_us']:.0f}).")
# The side-by-side targets (kvroute against Dynamo), judged on this run's medians and storm pairs.
checks = []
if "select" in summary:
    t = summary["select"]
    checks.append(("/select throughput ≥ 3× and p99 ≤ ⅓ of Dynamo's",
                   t["median_throughput_ratio"] >= 3 and t["median_p99_ratio"] <= 1 / 3,
                   f"{t['median_throughput_ratio']:.2f}×, p99 {t['median_p99_ratio']:.2f}"))
if "cycle" in summary:
    t = summary["cycle"]
    checks.append(("cycle throughput ≥ 3× Dynamo's, load generator sharing the servers' cores",
                   t["median_throughput_ratio"] >= 3, f"{t['median_throughput_ratio']:.2f}×"))
if "cycle_isolated" in summary:
    t = summary["cycle_isolated"]
    checks.append(("cycle throughput ≥ 3× Dynamo's, load generator on its own cores",
                   t["median_throughput_ratio"] >= 3, f"{t['median_throughput_ratio']:.2f}×"))
for r in storm_rows:
    if not r["target"]:
        continue
    checks.append((f"storm p99 rise < 2×, {r['engines']}", r["ratio"] < 2, f"{r['ratio']:.2f}×"))
if checks:
    lines += ["", "Targets (kvroute against Dynamo) in this run: " + "; ".join(
        f"{name}: {'met' if ok else 'NOT met'} ({value})" for name, ok, value in checks) + "."]
report["targets"] = [{"target": n, "met": ok, "value": v} for n, ok, v in checks]
os.makedirs(os.path.dirname(a.out), exist_ok=True)
json.dump(report, open(a.out, "w"), indent=2)
errs = sum(r["dynamo"]["errors"] + r["kvroute"]["errors"] for r in rows)
lines += ["", "Server CPU µs/req: the server process's CPU time (all threads) over the requests it "
          "answered; steal %: the larger share of the two runs' time the hypervisor gave to other "
          "guests (rounds with high steal ran on a slower machine).", "",
          f"Errors across all runs: {errs}."]
table = "\n".join(lines)
print(table)
if a.benchmarks:
    with open(a.benchmarks, "a") as f:
        f.write("\n" + table + "\n")
