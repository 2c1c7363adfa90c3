#!/usr/bin/env python3
"""Helpers of bench/gateway_aiperf.sh (standard library only).

  tokenizer --hub-cache DIR --name NAME
      Writes a character-level tokenizer as a Hugging Face hub cache entry,
      DIR/models--local--NAME/snapshots/<40 hex>/ + refs/main, so that aiperf (transformers'
      AutoTokenizer with HF_HUB_OFFLINE=1) loads it as `local/NAME` without any download, and
      prints the snapshot directory (what `kvroute gateway --tokenizer` and the engines'
      `--tokenizer` read too).
  summarize --run NAME=DIR ... --out-json F --out-md F [--meta KEY=VALUE ...]
      Reads aiperf's profile_export_aiperf.json of each run and writes one JSON and one
      markdown table: TTFT p50/p99, inter-token latency p99, request latency p99, requests.

The tokenizer: one token per character (the 256 code points 0-255, id = code point + 3, as the
mock engine's built-in byte tokenizer numbers ASCII; anything else is <unk>), a decoder that
joins tokens with nothing between them, and a chat template that renders exactly what the mock
engine's built-in template renders (`<|role|>\\ncontent<|end|>\\n` per message, then
`<|assistant|>\\n`). So aiperf's "N tokens" is N characters, and the gateway, rendering and
tokenizing a chat itself, computes the very token ids (and block hashes) the engines publish
KV events for.
"""

import argparse
import hashlib
import json
import os
import sys

OFFSET = 3
SPECIALS = {"<pad>": 0, "</s>": 1, "<unk>": 2}
# The mock engine's built-in chat template (crates/testkit/src/openai_engine/tokenizer.rs,
# `render_chat`), as Jinja.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def tokenizer_json():
    vocab = dict(SPECIALS)
    vocab.update({chr(c): c + OFFSET for c in range(256)})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for t, i in SPECIALS.items()
        ],
        "normalizer": None,
        # Every character its own piece ([\s\S]: newlines too, in onig and fancy-regex alike).
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"},
                          "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def tokenizer_config():
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "bos_token": None,
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(hub_cache, name):
    files = {
        "tokenizer.json": json.dumps(tokenizer_json(), sort_keys=True),
        "tokenizer_config.json": json.dumps(tokenizer_config(), sort_keys=True),
        # Not a model: only what AutoTokenizer and AutoConfig look at.
        "config.json": json.dumps({"model_type": "llama", "vocab_size": 256 + OFFSET}),
        "special_tokens_map.json": json.dumps(
            {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}),
    }
    # The snapshot's name stands for a commit: the hash of the files, so a changed tokenizer
    # gets a new snapshot.
    digest = hashlib.sha1()
    for k in sorted(files):
        digest.update(k.encode() + b"\0" + files[k].encode() + b"\0")
    commit = digest.hexdigest()
    repo = os.path.join(hub_cache, f"models--local--{name}")
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for k, v in files.items():
        with open(os.path.join(snap, k), "w") as f:
            f.write(v)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    print(snap)


METRICS = [  # (aiperf's tag, column)
    ("time_to_first_token", "TTFT"),
    ("inter_token_latency", "ITL"),
    # Every gap between chunks, not a request's mean gap: where a stall shows.
    ("inter_chunk_latency", "inter-chunk"),
    ("request_latency", "request latency"),
]


def stat(metric, key):
    if not isinstance(metric, dict):
        return None
    v = metric.get(key)
    return float(v) if isinstance(v, (int, float)) else None


def read_run(path):
    with open(path) as f:
        data = json.load(f)
    # aiperf's export: {"records": {tag: {...}}} in some versions, the tags at the top in others.
    records = data.get("records", data)
    if isinstance(records, list):
        records = {r.get("tag"): r for r in records if isinstance(r, dict)}
    out = {"unit_ms": True}
    for tag, _ in METRICS:
        m = records.get(tag)
        unit = (m or {}).get("unit", "ms")
        scale = {"ms": 1.0, "s": 1000.0, "ns": 1e-6, "us": 1e-3}.get(unit, 1.0)
        for q in ("avg", "p50", "p90", "p99", "max"):
            v = stat(m, q)
            out[f"{tag}_{q}_ms"] = None if v is None else v * scale

    def count(tag):
        v = stat(records.get(tag), "avg")
        return None if v is None else int(round(v))

    out["requests_ok"] = count("request_count")
    out["requests_failed"] = count("error_request_count") or 0
    for tag in ("request_throughput", "output_token_throughput", "output_sequence_length",
                "input_sequence_length"):
        out[tag] = stat(records.get(tag), "avg")
    # The engines' prefix-cache hits as their usage reports them (cached ÷ prompt tokens).
    cached = stat(records.get("usage_prompt_cache_read_tokens"), "avg")
    prompt = stat(records.get("usage_prompt_tokens"), "avg")
    out["cached_prompt_tokens_avg"] = cached
    out["prompt_tokens_avg"] = prompt
    out["prefix_hit_pct"] = 100 * cached / prompt if cached is not None and prompt else None
    # aiperf's own summary of every metric, as it wrote it.
    out["aiperf_metrics"] = {k: v for k, v in records.items()
                             if isinstance(v, dict) and "unit" in v}
    # Errors by kind, when aiperf lists them.
    errs = data.get("error_summary")
    if errs:
        out["error_summary"] = errs
    return out


def fmt(v, digits=0):
    if v is None:
        return "—"
    return f"{v:,.{digits}f}"


def pct(share):
    return "—" if share is None else f"{100 * share:.0f} %"


def summarize(args):
    runs = []
    for spec in args.run:
        name, _, d = spec.partition("=")
        path = os.path.join(d, "profile_export_aiperf.json")
        if not os.path.exists(path):
            runs.append({"server": name, "missing": path})
            continue
        r = read_run(path)
        r["server"] = name
        extra = os.path.join(d, "server.json")
        if os.path.exists(extra):
            with open(extra) as f:
                r.update(json.load(f))
        runs.append(r)
    meta = dict(kv.partition("=")[::2] for kv in args.meta)
    doc = {"meta": meta, "runs": runs}
    with open(args.out_json, "w") as f:
        json.dump(doc, f, indent=1)
    labels = {
        "kvroute": "kvroute gateway",
        "kvroute-rr": "kvroute gateway, round robin",
        "smg": "smg `cache_aware`",
    }
    lines = [
        "| front | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | request latency p99 ms "
        "| inter-chunk p99 ms | requests ok / failed | prefix cache hits | output tok/s "
        "| busiest engine's CPU share | server CPU / request |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        name = labels.get(r["server"], r["server"])
        if "missing" in r:
            lines.append(f"| {name} | no result ({r['missing']}) | | | | | | | | | |")
            continue
        lines.append(
            f"| {name} | {fmt(r['time_to_first_token_p50_ms'])} "
            f"| {fmt(r['time_to_first_token_p99_ms'])} "
            f"| {fmt(r['inter_token_latency_p99_ms'], 2)} "
            f"| {fmt(r['request_latency_p99_ms'])} "
            f"| {fmt(r['inter_chunk_latency_p99_ms'], 2)} "
            f"| {fmt(r['requests_ok'])} / {fmt(r['requests_failed'])} "
            f"| {fmt(r['prefix_hit_pct'], 1)} % "
            f"| {fmt(r['output_token_throughput'])} "
            f"| {pct(r.get('busiest_engine_cpu_share'))} "
            f"| {fmt(r.get('server_cpu_per_request_ms'), 2)} ms |"
        )
    by = {r["server"]: r for r in runs if "missing" not in r}
    kv = by.get("kvroute")
    notes = []
    if kv:
        for other in ("kvroute-rr", "smg"):
            o = by.get(other)
            if not o:
                continue
            parts = []
            for tag, label in (("time_to_first_token", "TTFT p99"),
                               ("inter_token_latency", "ITL p99")):
                a, b = kv[f"{tag}_p99_ms"], o[f"{tag}_p99_ms"]
                if a is not None and b:
                    verdict = "met" if a <= b else "**not met**"
                    parts.append(f"{label} {a / b:.2f}× ({verdict})")
            if parts:
                notes.append(f"kvroute ÷ {labels[other]}: " + ", ".join(parts) + ".")
    head = ", ".join(f"{k} {v}" for k, v in meta.items() if k != "config")
    md = ""
    if head:
        md += f"aiperf run: {head}. {meta.get('config', '')}\n\n"
    md += "\n".join(lines) + "\n"
    if notes:
        md += "\n" + "\n".join(notes) + "\n"
    with open(args.out_md, "w") as f:
        f.write(md)
    print(md)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer")
    t.add_argument("--hub-cache", required=True)
    t.add_argument("--name", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("--run", action="append", default=[], help="NAME=DIR (aiperf's artifact dir)")
    s.add_argument("--out-json", required=True)
    s.add_argument("--out-md", required=True)
    s.add_argument("--meta", action="append", default=[], help="KEY=VALUE")
    args = p.parse_args()
    if args.cmd == "tokenizer":
        write_tokenizer(args.hub_cache, args.name)
    else:
        summarize(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
