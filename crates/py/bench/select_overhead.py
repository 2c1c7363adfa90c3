"""Per-call cost of SelectionService.select from Python: N awaited selects (one at a time) of a
1,024-token prompt against 16 workers with block size 16, half of which hold part of the prompt.
Also the same with the prompt pre-hashed, and N selects issued concurrently (asyncio.gather).
Then an 8,192-token prompt against 64 workers (block size 64) with `token_ids` in each form:
list, `array('I')`, `bytes`, numpy `uint32` (when numpy is installed).

    python crates/py/bench/select_overhead.py [N]

Prints µs per call; compare with the Rust figure printed by
`cargo bench -p kvroute-service --bench ...` or the selector bench (see the README)."""

from __future__ import annotations

import array
import asyncio
import statistics
import sys
import time

import kvroute

WORKERS = 16
BLOCK = 16
TOKENS = 1024


async def setup():
    svc = kvroute.SelectionService()
    prompt = [(t * 2_654_435_761) % 150_000 for t in range(TOKENS)]
    hashes = kvroute.block_hashes(prompt, BLOCK)
    for w in range(WORKERS):
        await svc.upsert_worker({"worker_id": w, "endpoint": f"http://worker-{w}:8000", "block_size": BLOCK})
        if w % 2:
            held = TOKENS // BLOCK * w // WORKERS
            svc.apply_kv_events(w, [{
                "type": "BlockStored",
                "block_hashes": hashes["sequence_hashes"][:held],
                "token_ids": prompt[: held * BLOCK],
                "block_size": BLOCK,
            }])
    return svc, prompt, hashes


async def sequential(svc, request, n):
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        await svc.select(request)
        samples.append((time.perf_counter() - start) * 1e6)
    samples.sort()
    return statistics.fmean(samples), samples[len(samples) // 2], samples[int(len(samples) * 0.99)]


async def main(n):
    svc, prompt, hashes = await setup()
    tokens_request = {"token_ids": prompt}
    hashed_request = {
        "block_hashes": hashes["local_hashes"],
        "sequence_hashes": hashes["sequence_hashes"],
        "isl_tokens": TOKENS,
    }
    assert (await svc.select(tokens_request))["worker_id"] == WORKERS - 1
    await sequential(svc, tokens_request, 1000)  # warm-up
    for name, request in [("token_ids", tokens_request), ("pre-hashed", hashed_request)]:
        mean, p50, p99 = await sequential(svc, request, n)
        print(f"awaited select, {name:10} ({TOKENS} tokens, {WORKERS} workers): "
              f"mean {mean:.1f} us, p50 {p50:.1f} us, p99 {p99:.1f} us per call")
    start = time.perf_counter()
    await asyncio.gather(*[svc.select(tokens_request) for _ in range(n)])
    elapsed = time.perf_counter() - start
    print(f"concurrent select, token_ids ({n} via asyncio.gather): {elapsed / n * 1e6:.1f} us per call, "
          f"{n / elapsed:,.0f} selects/s")
    start = time.perf_counter()
    for _ in range(n):
        kvroute.block_hashes(prompt, BLOCK)
    print(f"block_hashes ({TOKENS} tokens): {(time.perf_counter() - start) / n * 1e6:.1f} us per call")
    svc.shutdown()
    await token_forms(n)


async def token_forms(n):
    svc = kvroute.SelectionService()
    for w in range(64):
        await svc.upsert_worker({"worker_id": w, "endpoint": f"http://worker-{w}:8000", "block_size": 64})
    prompt = [(t * 2_654_435_761) % 150_000 for t in range(8192)]
    forms = {
        "list": prompt,
        "array('I')": array.array("I", prompt),
        "bytes (LE u32)": array.array("I", prompt).tobytes(),
    }
    try:
        import numpy as np

        forms["numpy uint32"] = np.asarray(prompt, dtype=np.uint32)
        forms["numpy int64"] = np.asarray(prompt, dtype=np.int64)
    except ImportError:
        pass
    for name, tokens in forms.items():
        request = {"token_ids": tokens}
        await sequential(svc, request, n // 10)  # warm-up
        mean, p50, p99 = await sequential(svc, request, n)
        print(f"awaited select, 8192 tokens as {name:15} (64 workers): "
              f"mean {mean:.1f} us, p50 {p50:.1f} us, p99 {p99:.1f} us per call")
    svc.shutdown()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000))
