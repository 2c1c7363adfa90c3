#!/usr/bin/env python3
"""The fleet phase of side_by_side.sh as one table, "Select by W" (stdlib only).

    fleet_summary.py --dir RUNS --workers "64 1000 4000" --concurrency 32 --event-workers 1800 \
        --out results/fleet-DATE

Reads the load generator's runs labelled `<server>-<mode>-rfleet-<iso|shared>-<W>`, the
registrations `fleet/<server>-register-<W>.json` (bench/fleet_register.py) and the in-process
run `fleet/inprocess.json` (bench/inprocess.py); writes OUT.json and OUT.md and prints the table.
"""
import argparse, json, os, re

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--workers", required=True)
p.add_argument("--concurrency", type=int, required=True)
p.add_argument("--event-workers", type=int, default=None)
p.add_argument("--out", required=True)
a = p.parse_args()


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run(server, mode, placement, w):
    r = load(os.path.join(a.dir, f"{server}-{mode}-rfleet-{placement}-{w}.json"))
    if not r:
        return None
    m = r["routes"]["select"] if mode == "select" else r["cycles"]
    return {"rps": m["rps"], "p50_us": m["p50_us"], "p99_us": m["p99_us"],
            "errors": r.get("errors", 0), "server_cpu_s": r.get("server_cpu_s")}


def plain(text):
    """A log excerpt without its terminal colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text).strip()


def mib(registration):
    kib = registration.get("rss_after_kib")
    return None if kib is None else kib / 1024


def ratio(x, y):
    return x / y if x is not None and y else None


def f(x, spec=",.0f", none="—"):
    return none if x is None else format(x, spec)


workers = [int(w) for w in a.workers.split()]
out = {"workers": workers, "event_workers": a.event_workers, "concurrency": a.concurrency, "points": []}


def w_label(w):
    """W, with how many of its workers have a KV-event endpoint (are schedulable) when not all."""
    if a.event_workers is not None and w > a.event_workers:
        return f"{w:,} ({a.event_workers:,} with KV events)"
    return f"{w:,}"


lines = []
for placement, title in (("iso", "load generator on its own core (the configuration that counts)"),
                         ("shared", "load generator sharing the servers' cores")):
    rows = []
    for w in workers:
        point = {"workers": w, "placement": placement}
        for server in ("kvroute", "dynamo"):
            for mode in ("select", "cycle"):
                point[f"{server}_{mode}"] = run(server, mode, placement, w)
        if not any(point[k] for k in point if k.endswith(("select", "cycle"))):
            continue
        out["points"].append(point)
        ks, ds, kc, dc = (point.get(k) or {} for k in ("kvroute_select", "dynamo_select", "kvroute_cycle", "dynamo_cycle"))
        rows.append(
            f"| {w_label(w)} | {f(ks.get('rps'))} | {f(ks.get('p99_us'))} | {f(ds.get('rps'))} | {f(ds.get('p99_us'))} "
            f"| {f(ratio(ks.get('rps'), ds.get('rps')), '.1f')}× | {f(ratio(ks.get('p99_us'), ds.get('p99_us')), '.2f')} "
            f"| {f(kc.get('rps'))} | {f(dc.get('rps'))} | {f(ratio(kc.get('rps'), dc.get('rps')), '.1f')}× "
            f"| {f(kc.get('p99_us'))} | {f(dc.get('p99_us'))} |")
    if rows:
        lines += [f"**{title}**, C = {a.concurrency}:", "",
                  "| W | kvroute /select/s | p99 µs | Dynamo /select/s | p99 µs | throughput × | p99 ratio | kvroute cycles/s | Dynamo cycles/s | × | kvroute cycle p99 µs | Dynamo cycle p99 µs |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, ""]

reg_rows, failures = [], []
for w in workers:
    k = load(os.path.join(a.dir, "fleet", f"kvroute-register-{w}.json"))
    d = load(os.path.join(a.dir, "fleet", f"dynamo-register-{w}.json"))
    if not k and not d:
        continue
    k, d = k or {}, d or {}
    out.setdefault("registration", []).append({"workers": w, "kvroute": k, "dynamo": d})
    for name, r in (("kvroute", k), ("dynamo", d)):
        if "failed_at" in r:
            failures.append(f"- {name} failed registering up to {w:,} workers "
                            f"({'still answering' if r['alive'] else 'process gone'}): "
                            f"`{plain(r['log'])[-200:]}`")
    def lc(r):
        c = r.get("lifecycles")
        return "—" if not c else ", ".join(f"{n:,} {k}" for k, n in sorted(c.items()))
    if k.get("lifecycles") and d.get("lifecycles") and k["lifecycles"] != d["lifecycles"]:
        failures.append(f"- at {w:,} the servers gave the same registrations different lifecycles "
                        f"(workers without a KV-event endpoint): kvroute {lc(k)}, Dynamo {lc(d)}")
    reg_rows.append(
        f"| {w_label(w)} | {f(k.get('workers_added'))} | {lc(k)} | {lc(d)} "
        f"| {f(k.get('registrations_per_s'))} | {f(d.get('registrations_per_s'))} "
        f"| {f(mib(k), ',.1f')} | {f(mib(d), ',.1f')} "
        f"| {f(k.get('rss_per_worker_kib'), ',.1f')} | {f(d.get('rss_per_worker_kib'), ',.1f')} "
        f"| {f(k.get('open_files_after'))} | {f(d.get('open_files_after'))} |")
if reg_rows:
    same = ("Both servers got the same registrations (ids 1..=W, block size 64"
            + (f"; KV-event endpoints for ids 1..={a.event_workers:,} only, the rest registered without one"
               if a.event_workers is not None else "") + ").")
    lines += ["**Registration and memory** (one keep-alive client; RSS and open files after the listeners settle, "
              "before any fake engine listens: no KV-event connection is counted). " + same, "",
              "| W | workers added | kvroute lifecycles | Dynamo lifecycles | kvroute registrations/s | Dynamo | kvroute RSS MiB | Dynamo RSS MiB | kvroute KiB per added worker | Dynamo | kvroute open files | Dynamo open files |",
              "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|", *reg_rows, "", *failures, ""]

inproc = load(os.path.join(a.dir, "fleet", "inprocess.json"))
if inproc:
    out["inprocess"] = inproc
    m = inproc["median"]
    d = m["dynamo"]
    lines += [f"**In process from Python**, {inproc['tokens']:,}-token prompts, {inproc['workers']} workers, one call at a time (median of rounds):", "",
              "| caller | selects/s | select p99 µs | cycles/s | cycle p99 µs | select × Dynamo | cycle × Dynamo |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, label in (("dynamo", "Dynamo `dynamo.llm.SelectionService`, list"),
                        ("kvroute-list", "kvroute `SelectionService`, list"),
                        ("kvroute-array", "kvroute `SelectionService`, `array('I')`")):
        r = m[name]
        lines.append(f"| {label} | {f(r['select_per_s'])} | {f(r['select_p99_us'])} | {f(r['cycle_per_s'])} "
                     f"| {f(r['cycle_p99_us'])} | {f(ratio(r['select_per_s'], d['select_per_s']), '.1f')}× "
                     f"| {f(ratio(r['cycle_per_s'], d['cycle_per_s']), '.1f')}× |")
    lines.append("")

text = "\n".join(lines)
print(text)
with open(a.out + ".md", "w") as fh:
    fh.write(text + "\n")
with open(a.out + ".json", "w") as fh:
    json.dump(out, fh, indent=1)
