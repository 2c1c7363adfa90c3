#!/usr/bin/env python3
"""Generate block-hash fixtures from NVIDIA Dynamo's own hashing function.

Calls `dynamo.llm.compute_block_hash_for_seq` (package ai-dynamo-runtime==1.6.1)
on a fixed, seeded set of inputs covering block sizes, token lengths (including
trailing partial blocks), large token ids, LoRA names, cache salts, Eagle mode and
per-block multimodal infos, and writes the results to
crates/core/tests/fixtures/dynamo_block_hashes.json.

Setup (once):
    python3 -m venv /work/venv-dynhash
    /work/venv-dynhash/bin/pip install ai-dynamo-runtime==1.6.1 xxhash
Run from the repository root:
    /work/venv-dynhash/bin/python bench/dynamo/gen_hash_fixtures.py

Notes on Dynamo 1.6.1's Python signature:
    compute_block_hash_for_seq(tokens, kv_block_size, block_mm_infos=None,
                               lora_name=None, is_eagle=None, cache_namespace=None)
The fixture field `cache_salt` is passed as `cache_namespace` (the name 1.6.1 uses
for the request-wide salt). The returned values are *local* block hashes (not chained
sequence hashes).

If the `xxhash` package is importable, every case is also recomputed with an
independent model of the algorithm and the script fails on any mismatch.
"""

import itertools
import json
import os
import random
import struct
import sys

from dynamo.llm import compute_block_hash_for_seq

try:
    import xxhash  # optional cross-check
except ImportError:  # pragma: no cover
    xxhash = None

DYNAMO_VERSION = "1.6.1"
GENERATOR = "bench/dynamo/gen_hash_fixtures.py"
SEED = 20240611
BLOCK_SIZES = [1, 2, 4, 16, 32, 64]
U64 = (1 << 64) - 1
OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..", "..", "crates", "core", "tests", "fixtures", "dynamo_block_hashes.json",
)

LORA_NAMES = ["my-lora", "adapter/sql-v2", "ü-unicode-lora", "x" * 70]
SALTS = ["tenant-a", "salt:42", "s", "日本語-salt" * 3]


def dynamo_hashes(case):
    kwargs = {}
    if case["block_mm_infos"] is not None:
        kwargs["block_mm_infos"] = case["block_mm_infos"]
    if case["lora_name"] is not None:
        kwargs["lora_name"] = case["lora_name"]
    if case["is_eagle"] is not None:
        kwargs["is_eagle"] = case["is_eagle"]
    if case["cache_salt"] is not None:
        kwargs["cache_namespace"] = case["cache_salt"]
    return compute_block_hash_for_seq(case["tokens"], case["block_size"], **kwargs)


def model_hashes(case):
    """Independent re-statement of the algorithm, for cross-checking."""
    h = xxhash.xxh3_64_intdigest
    seed = 1337
    if case["lora_name"]:
        seed = (seed + h(case["lora_name"].encode(), 0)) & U64
    if case["cache_salt"]:
        seed = (seed + h(case["cache_salt"].encode(), 1)) & U64
    bs = case["block_size"]
    window = bs + 1 if case["is_eagle"] else bs
    infos = case["block_mm_infos"] or []
    toks = case["tokens"]
    out = []
    start, idx = 0, 0
    while start + window <= len(toks):
        data = struct.pack("<%dI" % window, *toks[start:start + window])
        info = infos[idx] if idx < len(infos) else None
        if info is not None:
            for m in sorted(o["mm_hash"] for o in info["mm_objects"]):
                data += struct.pack("<Q", m)
        out.append(h(data, seed))
        start += bs
        idx += 1
    return out


def rand_token(rng):
    r = rng.random()
    if r < 0.6:
        return rng.randrange(0, 200_000)
    if r < 0.9:
        return rng.randrange(0, 1 << 32)
    return rng.choice([0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1])


def rand_len(rng, bs):
    r = rng.random()
    if r < 0.08:
        return rng.choice([0, 1, bs - 1 if bs > 1 else 0, bs, bs + 1])
    if r < 0.35:  # exact multiple of the block size
        return bs * rng.randrange(0, max(1, 300 // bs) + 1)
    if r < 0.5 and bs > 1:  # one more than a multiple (Eagle boundary)
        return bs * rng.randrange(0, max(1, 299 // bs) + 1) + 1
    return rng.randrange(0, 301)


def rand_mm_hash(rng):
    r = rng.random()
    if r < 0.1:
        return rng.choice([0, 1, U64, 1 << 63, (1 << 63) - 1])
    if r < 0.25:
        return rng.randrange(0, 1 << 32)
    return rng.randrange(0, 1 << 64)


def rand_offsets(rng, bs):
    offs = []
    for _ in range(rng.randint(1, 2)):
        start = rng.randrange(0, bs)
        if rng.random() < 0.3:  # spans past the end of the block
            end = bs + rng.randrange(1, 2 * bs + 1)
        else:
            end = rng.randint(start + 1, bs)
        offs.append([start, end])
    return offs


def rand_mm_infos(rng, n_tokens, bs, eagle):
    window = bs + 1 if eagle else bs
    n_blocks = 0 if n_tokens < window else (n_tokens - window) // bs + 1
    n_slots = n_blocks + (1 if n_tokens > n_blocks * bs else 0)  # + partial block
    r = rng.random()
    if r < 0.1:
        n_slots = rng.randrange(0, n_slots + 1)  # too short: missing infos = None
    elif r < 0.2:
        n_slots += rng.randint(1, 3)  # too long: extra infos are ignored
    infos = []
    for _ in range(n_slots):
        x = rng.random()
        if x < 0.45:
            infos.append(None)
            continue
        if x < 0.5:
            infos.append({"mm_objects": []})
            continue
        objs = []
        for _ in range(rng.randint(1, 3)):
            if objs and rng.random() < 0.15:  # duplicate hash in the same block
                mm = objs[-1]["mm_hash"]
            else:
                mm = rand_mm_hash(rng)
            offsets = [] if rng.random() < 0.1 else rand_offsets(rng, bs)
            objs.append({"mm_hash": mm, "offsets": offsets})
        infos.append({"mm_objects": objs})
    # Make sure at least one full block usually carries an object.
    if n_blocks and all(i is None or not i["mm_objects"] for i in infos[:n_blocks]) \
            and rng.random() < 0.8 and infos:
        k = rng.randrange(0, min(n_blocks, len(infos)))
        infos[k] = {"mm_objects": [{"mm_hash": rand_mm_hash(rng),
                                    "offsets": rand_offsets(rng, bs)}]}
    return infos


def make_case(rng, bs, lora, salt, eagle, mm):
    n = rand_len(rng, bs)
    tokens = [rand_token(rng) for _ in range(n)]
    return {
        "tokens": tokens,
        "block_size": bs,
        "lora_name": rng.choice(LORA_NAMES) if lora else None,
        "cache_salt": rng.choice(SALTS) if salt else None,
        "is_eagle": eagle,
        "block_mm_infos": rand_mm_infos(rng, n, bs, bool(eagle)) if mm else None,
    }


def edge_cases(rng):
    """Hand-picked cases: empty-string identities, identical tokens with different MM."""
    toks = [rand_token(rng) for _ in range(40)]
    base = {"tokens": toks, "block_size": 16, "lora_name": None, "cache_salt": None,
            "is_eagle": None, "block_mm_infos": None}
    out = [
        dict(base, lora_name=""),  # empty string == absent
        dict(base, cache_salt=""),
        dict(base, lora_name="", cache_salt="", is_eagle=False),
        dict(base, block_mm_infos=[]),
        dict(base, block_mm_infos=[None, None, None]),
        dict(base, block_mm_infos=[{"mm_objects": []}, {"mm_objects": []}]),
        # same objects, different order and offsets -> same hash as the next case
        dict(base, block_mm_infos=[{"mm_objects": [
            {"mm_hash": U64, "offsets": [[0, 4]]}, {"mm_hash": 7, "offsets": [[4, 16]]}]}]),
        dict(base, block_mm_infos=[{"mm_objects": [
            {"mm_hash": 7, "offsets": [[3, 99]]}, {"mm_hash": U64, "offsets": []}]}]),
        # info only on the trailing partial block -> ignored
        dict(base, block_mm_infos=[None, None, {"mm_objects": [{"mm_hash": 5, "offsets": [[0, 8]]}]}]),
        dict(base, is_eagle=True, block_mm_infos=[{"mm_objects": [{"mm_hash": 5, "offsets": [[0, 17]]}]},
                                                 {"mm_objects": [{"mm_hash": 6, "offsets": [[0, 1]]}]}]),
        dict(base, tokens=toks[:33], is_eagle=True),  # exactly 2 eagle windows
        dict(base, tokens=toks[:32], is_eagle=True),  # only 1
        dict(base, tokens=toks[:17], is_eagle=True, block_size=16),
        dict(base, tokens=toks[:16], is_eagle=True, block_size=16),  # no window
        dict(base, tokens=[(1 << 32) - 1] * 64, block_size=64, lora_name="L", cache_salt="S"),
    ]
    return out


REJECT_PROBES = [
    ({"tokens": [1, 2, 3], "block_size": 0}, "block_size 0"),
    ({"tokens": [1 << 32], "block_size": 1}, "token >= 2^32"),
    ({"tokens": [-1], "block_size": 1}, "negative token"),
    ({"tokens": [1, 2], "block_size": 1,
      "block_mm_infos": [{"mm_objects": [{"mm_hash": 5}]}]}, "mm object without offsets"),
    ({"tokens": [1, 2], "block_size": 1, "block_mm_infos": [{}]}, "block info without mm_objects"),
    ({"tokens": [1, 2], "block_size": 1,
      "block_mm_infos": [{"mm_objects": [{"mm_hash": -1, "offsets": []}]}]}, "negative mm_hash"),
    ({"tokens": [1, 2], "block_size": 1,
      "block_mm_infos": [{"mm_objects": [{"mm_hash": 1 << 64, "offsets": []}]}]}, "mm_hash >= 2^64"),
    ({"tokens": [1, 2], "block_size": 1,
      "block_mm_infos": [{"mm_objects": [{"mm_hash": 5, "offsets": [[0, 1, 2]]}]}]}, "offset triple"),
    ({"tokens": [1, 2], "block_size": 1,
      "block_mm_infos": [{"mm_objects": [{"mm_hash": 5, "offsets": [[-1, 1]]}]}]}, "negative offset"),
    ({"tokens": [1, 2], "block_size": 1,
      "block_mm_infos": [{"mm_objects": [{"mm_hash": 5, "offsets": None}]}]}, "offsets null"),
    ({"tokens": [1, 2], "block_size": 1, "block_mm_infos": [{"mm_objects": None}]}, "mm_objects null"),
]


def main():
    rng = random.Random(SEED)
    cases = []
    # Every combination of (lora, salt, eagle in {None, False, True}, mm) for every
    # block size, twice.
    combos = list(itertools.product([False, True], [False, True], [None, False, True], [False, True]))
    for bs in BLOCK_SIZES:
        for lora, salt, eagle, mm in combos:
            for _ in range(2):
                cases.append(make_case(rng, bs, lora, salt, eagle, mm))
    cases.extend(edge_cases(rng))

    for c in cases:
        c["hashes"] = dynamo_hashes(c)
        if xxhash is not None:
            want = model_hashes(c)
            if want != c["hashes"]:
                sys.exit("model mismatch on case %r" % {k: c[k] for k in c if k != "tokens"})

    rejected = []
    for probe, what in REJECT_PROBES:
        c = {"tokens": [], "block_size": 1, "lora_name": None, "cache_salt": None,
             "is_eagle": None, "block_mm_infos": None}
        c.update(probe)
        try:
            res = dynamo_hashes(c)
        except Exception as e:  # noqa: BLE001 - recording whatever Dynamo raised
            c["error"] = "%s: %s" % (type(e).__name__, e)
            c["what"] = what
            rejected.append(c)
        else:
            sys.exit("expected rejection for %s, got %r" % (what, res))

    doc = {
        "dynamo_version": DYNAMO_VERSION,
        "generator": GENERATOR,
        "cases": cases,
        "rejected": rejected,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write("{\n")
        f.write('"dynamo_version": %s,\n' % json.dumps(DYNAMO_VERSION))
        f.write('"generator": %s,\n' % json.dumps(GENERATOR))
        for key in ("cases", "rejected"):
            f.write('"%s": [\n' % key)
            f.write(",\n".join(json.dumps(c, ensure_ascii=False, separators=(",", ":"))
                               for c in doc[key]))
            f.write("\n]%s\n" % ("," if key == "cases" else ""))
        f.write("}\n")
    json.load(open(OUT))  # sanity
    print("wrote %d cases, %d rejected, %d bytes to %s%s" % (
        len(cases), len(rejected), os.path.getsize(OUT), os.path.normpath(OUT),
        "" if xxhash is None else " (cross-checked)"))


if __name__ == "__main__":
    main()
