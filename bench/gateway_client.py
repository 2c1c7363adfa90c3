#!/usr/bin/env python3
"""Streaming client for bench/gateway.sh: replays a Mooncake trace against an OpenAI-compatible
server (`POST /v1/completions`, `stream: true`) and measures what a client sees.

Modes:
  trace        open loop: request i is sent at t0 + (timestamp_i - timestamp_0) / --speedup,
               whether or not earlier ones finished (arrivals never wait for the server).
  concurrency  closed loop: --concurrency streams, each sending its next request as soon as
               its last one ended (the gateway-overhead measurement: 100 streams open at once).

Prompts are expanded from the trace's 512-token `hash_ids` exactly as kvroute's simulator does
(`crates/sim/src/workload.rs`, `mooncake_tokens`): id `h` becomes the tokens
`mix64(mix64(h) ^ j * 0xd6e8feb86659fd93) >> 32` for j in 0..512, cut at `input_length` (then at
--max-prompt-tokens), so equal ids give equal tokens and prompts share prefixes exactly where the
trace says. They are sent as text by default, one ASCII character per token, which the mock
engine's byte-level tokenizer turns back into one token each (SMG's /v1/completions takes only
text); --prompt-format tokens sends the same prompts as those token ids, raw as the simulator's
own ids. `max_tokens` is the row's `output_length` capped at --max-output-tokens.

Measured per request, on the client's monotonic clock from the first byte written: TTFT (the
first SSE `data:` chunk whose text is not empty), E2E (`data: [DONE]` or the body's end), the
number of content chunks, the HTTP status and the error if any. A request fails when its status
is not 200, the stream carries an `error` object, ends without `[DONE]`, or it exceeds
--timeout-secs. Every loop is bounded: at most --requests requests, none sent after
--duration-secs, and at most --drain-secs of waiting for the last ones (those left then count
as `timeout` errors).

HTTP/1.1 over asyncio streams (no client library): keep-alive connections reused per host,
bodies with Content-Length, chunked responses decoded here. Python's per-chunk cost is paid on
the client's core, the same for every server measured.

With --record-routes the client reads `x-kvroute-worker-id` from each response and, after the
run, the gateway's `GET /workers` (worker id -> endpoint), and stores each request's engine
URL; --replay-routes FILE sends request i straight to that engine (the engine-direct baseline
of the overhead measurement, see bench/gateway.sh).
"""

import argparse
import asyncio
import json
import math
import os
import resource
import sys
import time
import urllib.parse
import urllib.request

TOKENS_PER_HASH_ID = 512
MASK64 = (1 << 64) - 1
UNIQUE_SEGMENT = 1 << 63
ID_MASK = MASK64 & ~(7 << 61)


def mix64(z):
    """splitmix64's finaliser, as kvroute-sim's `mix64`."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


_STEP = [(j * 0xD6E8FEB86659FD93) & MASK64 for j in range(TOKENS_PER_HASH_ID)]


def segment(key, length):
    """The first `length` tokens of the segment named `key` (kvroute-sim's `push_segment`)."""
    base = mix64(key)
    if length <= TOKENS_PER_HASH_ID:
        return [mix64(base ^ _STEP[j]) >> 32 for j in range(length)]
    return [mix64(base ^ ((j * 0xD6E8FEB86659FD93) & MASK64)) >> 32 for j in range(length)]


# Text prompts: trace token t becomes ALPHABET[t % 62], one ASCII byte, so the mock engine's
# byte-level tokenizer (byte b -> id b + 3) gives exactly one token per trace token.
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
BYTE_TOKEN_OFFSET = 3


class PromptBuilder:
    """Request bodies from trace rows; each hash id's 512 tokens are rendered once.

    Formats (the same prompts, tokens for tokens):
      text    a string of one ASCII character per token (servers that take only text);
      tokens  the ids the mock engine's byte-level tokenizer gives that text;
      raw     the simulator's own 32-bit ids (kvroute-sim's `mooncake_tokens`).
    """

    def __init__(self, model, max_prompt_tokens, max_output_tokens, prompt_format, usage=False):
        self.model = model
        # Ask for the usage chunk (the mock engine reports its own TTFT there).
        self.stream_options = ',"stream_options":{"include_usage":true}' if usage else ""
        self.max_prompt_tokens = max_prompt_tokens
        self.max_output_tokens = max_output_tokens
        self.prompt_format = prompt_format
        self._ids = {}  # segment key -> its rendered tokens (str for text, list of str else)

    def _render(self, tokens):
        if self.prompt_format == "text":
            return "".join(ALPHABET[t % len(ALPHABET)] for t in tokens)
        if self.prompt_format == "tokens":
            return [str(ord(ALPHABET[t % len(ALPHABET)]) + BYTE_TOKEN_OFFSET) for t in tokens]
        return [str(t) for t in tokens]

    def _block(self, key):
        rendered = self._ids.get(key)
        if rendered is None:
            rendered = self._render(segment(key, TOKENS_PER_HASH_ID))
            self._ids[key] = rendered
        return rendered

    def body(self, row, row_index):
        length = min(int(row["input_length"]), self.max_prompt_tokens)
        parts = []
        have = 0
        for hash_id in row["hash_ids"]:
            if have >= length:
                break
            take = min(TOKENS_PER_HASH_ID, length - have)
            parts.append(self._block(hash_id & ID_MASK)[:take])
            have += take
        if have < length:  # a malformed row: tokens of its own, as the simulator does
            parts.append(self._render(segment(UNIQUE_SEGMENT | row_index, length - have)))
            have = length
        max_tokens = max(1, min(int(row["output_length"]), self.max_output_tokens))
        if self.prompt_format == "text":
            prompt = json.dumps("".join(parts))
        else:
            prompt = "[" + ",".join(",".join(p) for p in parts) + "]"
        body = '{"model":%s,"max_tokens":%d,"stream":true%s,"prompt":%s}' % (
            json.dumps(self.model),
            max_tokens,
            self.stream_options,
            prompt,
        )
        return body.encode(), have, max_tokens


def byte_tokenizer_json():
    """A HuggingFace tokenizer.json that tokenizes like the mock engine's built-in byte-level
    tokenizer on printable ASCII (each character its own token, id = byte + 3, nothing added),
    for a gateway that must tokenize the text prompts itself."""
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    vocab.update({chr(b): b + BYTE_TOKEN_OFFSET for b in range(32, 127)})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"Regex": "."},
            "behavior": "Isolated",
            "invert": False,
        },
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def read_trace(path, skip, limit):
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < skip or not line.strip():
                continue
            if len(rows) >= limit:
                break
            rows.append(json.loads(line))
    if not rows:
        raise SystemExit(f"{path}: no requests after skipping {skip}")
    return rows


def percentile(sorted_values, q):
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


class HttpError(Exception):
    def __init__(self, kind, detail=""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class Pool:
    """Idle keep-alive connections per (host, port)."""

    def __init__(self):
        self.idle = {}
        self.opened = 0

    async def get(self, host, port):
        conns = self.idle.get((host, port))
        while conns:
            reader, writer = conns.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer
            writer.close()
        self.opened += 1
        return await asyncio.open_connection(host, port, limit=1 << 20)

    def put(self, host, port, conn):
        self.idle.setdefault((host, port), []).append(conn)

    def close(self):
        for conns in self.idle.values():
            for _, writer in conns:
                writer.close()
        self.idle.clear()


async def stream_completion(pool, base, body, record):
    """POSTs one streaming completion and fills `record` (times relative to its start)."""
    url = urllib.parse.urlsplit(base)
    host, port = url.hostname, url.port or 80
    path = (url.path.rstrip("/") or "") + "/v1/completions"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    reader, writer = await pool.get(host, port)
    reusable = False
    start = time.perf_counter()
    record["start"] = start
    try:
        writer.write(head)
        writer.write(body)
        await writer.drain()
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            raise HttpError("connection closed before the response", str(e)) from None
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        record["status"] = status
        worker = headers.get("x-kvroute-worker-id")
        if worker is not None:
            record["worker_id"] = worker
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        keep_alive = headers.get("connection", "").lower() != "close"

        sse = SseReader(record, start)
        if chunked:
            await read_chunked(reader, sse)
        elif "content-length" in headers:
            sse.feed(await reader.readexactly(int(headers["content-length"])))
        else:
            sse.feed(await reader.read())
            keep_alive = False
        record["e2e_s"] = time.perf_counter() - start
        sse.finish()
        reusable = keep_alive
        if status != 200:
            raise HttpError(f"http {status}", sse.text_head())
        if sse.error:
            raise HttpError("error in stream", sse.error)
        if not sse.done:
            raise HttpError("stream ended without [DONE]")
        if record.get("ttft_s") is None:
            raise HttpError("no content chunk")
    finally:
        if reusable:
            pool.put(host, port, (reader, writer))
        else:
            writer.close()


async def read_chunked(reader, sse):
    """Decodes a chunked body into `sse`, reading whatever has arrived at once (one await per
    read, not two per chunk). Nothing follows the body before the next request (no
    pipelining), so reading ahead never takes another response's bytes."""
    buf = b""
    pos = 0
    while True:
        nl = buf.find(b"\r\n", pos)
        if nl >= 0:
            size = int(buf[pos:nl].split(b";", 1)[0], 16)
            end = nl + 2 + size + 2  # the last chunk: "0\r\n" then "\r\n" (no trailers)
            if len(buf) >= end:
                if size == 0:
                    return
                sse.feed(buf[nl + 2 : end - 2])
                pos = end
                continue
        data = await reader.read(1 << 16)
        if not data:
            raise asyncio.IncompleteReadError(buf[pos:], None)
        buf = buf[pos:] + data
        pos = 0


class SseReader:
    """Reads `data:` lines; JSON-parses chunks only until the first content and for errors."""

    def __init__(self, record, start):
        self.record = record
        self.start = start
        self.buf = b""
        self.done = False
        self.error = None
        self.chunks = 0
        self.raw_head = b""

    def feed(self, data):
        if len(self.raw_head) < 300:
            self.raw_head += data[: 300 - len(self.raw_head)]
        self.buf += data
        while True:
            nl = self.buf.find(b"\n")
            if nl < 0:
                return
            line, self.buf = self.buf[:nl].rstrip(b"\r"), self.buf[nl + 1 :]
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            if b'"error"' in payload:
                try:
                    err = json.loads(payload).get("error")
                except ValueError:
                    err = payload[:200].decode("utf-8", "replace")
                if err:
                    self.error = str(err)[:300]
                    continue
            if b'"kvroute_engine_ttft_us"' in payload:
                try:
                    usage = json.loads(payload).get("usage") or {}
                    self.record["engine_ttft_s"] = usage["kvroute_engine_ttft_us"] / 1e6
                except (ValueError, KeyError, TypeError):
                    pass
            if self.record.get("ttft_s") is None:
                try:
                    choices = json.loads(payload).get("choices") or []
                except ValueError:
                    continue
                if any(c.get("text") for c in choices):
                    self.record["ttft_s"] = time.perf_counter() - self.start
                    self.chunks += 1
            else:
                self.chunks += 1

    def finish(self):
        if self.buf.strip():
            self.feed(b"\n")
        self.record["chunks"] = self.chunks

    def text_head(self):
        return self.raw_head.decode("utf-8", "replace")[:200]


async def one_request(pool, base, body, record, timeout):
    try:
        await asyncio.wait_for(stream_completion(pool, base, body, record), timeout)
        record["ok"] = True
    except asyncio.TimeoutError:
        record["ok"] = False
        record["error"] = "timeout"
    except asyncio.CancelledError:
        record["ok"] = False
        record["error"] = "cancelled (drain time over)"
        raise
    except HttpError as e:
        record["ok"] = False
        record["error"] = str(e)
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
        record["ok"] = False
        record["error"] = f"{type(e).__name__}: {e}"


async def run_trace(args, bodies, offsets, base_for):
    """Open loop: each request at its (scaled) trace time."""
    pool = Pool()
    records = [{"index": i} for i in range(len(bodies))]
    tasks = []
    t0 = time.perf_counter() + 0.05
    deadline = t0 + args.duration_secs
    for i, (body, offset) in enumerate(zip(bodies, offsets)):
        due = t0 + offset
        if due > deadline:
            break
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        records[i]["sent_late_s"] = time.perf_counter() - due
        tasks.append(
            asyncio.create_task(one_request(pool, base_for(i), body, records[i], args.timeout_secs))
        )
    sent = len(tasks)
    send_end = time.perf_counter()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=args.drain_secs)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    end = time.perf_counter()
    pool.close()
    return records[:sent], t0, send_end, end, pool.opened


async def run_concurrency(args, bodies, base_for):
    """Closed loop: --concurrency streams take the next request as soon as theirs ends."""
    pool = Pool()
    records = [{"index": i} for i in range(len(bodies))]
    next_index = 0
    t0 = time.perf_counter()
    deadline = t0 + args.duration_secs

    async def stream_loop():
        nonlocal next_index
        while next_index < len(bodies) and time.perf_counter() < deadline:
            i = next_index
            next_index += 1
            await one_request(pool, base_for(i), bodies[i], records[i], args.timeout_secs)

    loops = [asyncio.create_task(stream_loop()) for _ in range(args.concurrency)]
    _, pending = await asyncio.wait(loops, timeout=args.duration_secs + args.drain_secs)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    end = time.perf_counter()
    pool.close()
    sent = next_index
    return records[:sent], t0, deadline if end > deadline else end, end, pool.opened


def summarize(records, t0, send_end, end):
    ok = [r for r in records if r.get("ok")]
    ttft = sorted(r["ttft_s"] for r in ok)
    e2e = sorted(r["e2e_s"] for r in ok)
    errors = {}
    for r in records:
        if not r.get("ok"):
            errors[r.get("error", "unknown")] = errors.get(r.get("error", "unknown"), 0) + 1
    ms = lambda v: None if v is None else round(v * 1000, 3)  # noqa: E731
    last_done = max((r["start"] + r["e2e_s"] for r in ok), default=t0)
    span = max(last_done - t0, 1e-9)
    late = sorted(r.get("sent_late_s", 0.0) for r in records)
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "error_kinds": errors,
        "ttft_ms": {f"p{q}": ms(percentile(ttft, q)) for q in (50, 90, 99)}
        | {"mean": ms(sum(ttft) / len(ttft)) if ttft else None},
        "e2e_ms": {f"p{q}": ms(percentile(e2e, q)) for q in (50, 90, 99)}
        | {"mean": ms(sum(e2e) / len(e2e)) if e2e else None},
        "output_chunks": sum(r.get("chunks", 0) for r in ok),
        "throughput_rps": len(ok) / span,
        "output_tokens_per_s": sum(r.get("chunks", 0) for r in ok) / span,
        "duration_s": span,
        "send_window_s": send_end - t0,
        "send_late_ms_p99": ms(percentile(late, 99)),
        "wall_s": end - t0,
    }


def cpu_counters():
    """/proc/stat's per-CPU counters: {"0": [user, nice, system, idle, iowait, ...], ...}."""
    try:
        with open("/proc/stat") as f:
            return {
                l.split()[0][3:]: list(map(int, l.split()[1:9]))
                for l in f
                if l.startswith("cpu") and l[3].isdigit()
            }
    except OSError:
        return {}


def busy_pct(before, after):
    out = {}
    for cpu, b in before.items():
        d = [y - x for x, y in zip(b, after.get(cpu, b))]
        total = sum(d)
        out[cpu] = round(100 * (total - d[3] - d[4]) / total, 1) if total else None
    return out


def fetch_json(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["trace", "concurrency", "byte-tokenizer"],
                   help="byte-tokenizer: write the byte-level tokenizer.json to --out and exit")
    p.add_argument("--url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", help="Mooncake JSONL trace")
    p.add_argument("--skip", type=int, default=0, help="trace rows to skip first")
    p.add_argument("--requests", type=int, default=600, help="at most this many requests")
    p.add_argument("--duration-secs", type=float, default=60.0, help="no request sent after this")
    p.add_argument("--drain-secs", type=float, default=60.0, help="most waiting for the last ones")
    p.add_argument("--timeout-secs", type=float, default=120.0, help="per request")
    p.add_argument("--speedup", type=float, default=1.0, help="trace mode: arrivals this much denser")
    p.add_argument("--concurrency", type=int, default=100, help="concurrency mode: open streams")
    p.add_argument("--max-prompt-tokens", type=int, default=16384)
    p.add_argument("--max-output-tokens", type=int, default=256)
    p.add_argument("--model", default="default")
    p.add_argument("--prompt-format", choices=["text", "tokens", "raw"], default="text",
                   help="text, or the same prompts as token ids (see PromptBuilder)")
    p.add_argument("--label", default="run")
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--engine-ttft", action="store_true",
                   help="ask for the usage chunk and record the mock engine's own TTFT "
                        "(`usage.kvroute_engine_ttft_us`) as engine_ttft_s per request")
    p.add_argument("--record-routes", action="store_true",
                   help="store each request's engine URL (x-kvroute-worker-id and GET /workers)")
    p.add_argument("--replay-routes", help="send request i to the engine a --record-routes run stored")
    p.add_argument("--per-request", action="store_true", help="keep every request's record")
    args = p.parse_args()
    if args.mode == "byte-tokenizer":
        with open(args.out, "w") as f:
            json.dump(byte_tokenizer_json(), f)
        return
    if not (args.url and args.trace):
        raise SystemExit("--url and --trace are required")
    for name in ("requests", "concurrency", "max_prompt_tokens", "max_output_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    if not (args.speedup > 0 and args.duration_secs > 0 and args.timeout_secs > 0):
        raise SystemExit("--speedup, --duration-secs and --timeout-secs must be positive")

    rows = read_trace(args.trace, args.skip, args.requests)
    builder = PromptBuilder(
        args.model, args.max_prompt_tokens, args.max_output_tokens, args.prompt_format,
        usage=args.engine_ttft,
    )
    built = time.perf_counter()
    bodies, prompt_tokens, max_tokens = [], [], []
    for i, row in enumerate(rows):
        body, n, m = builder.body(row, args.skip + i)
        bodies.append(body)
        prompt_tokens.append(n)
        max_tokens.append(m)
    built = time.perf_counter() - built
    first = float(rows[0]["timestamp"])
    offsets = [(float(r["timestamp"]) - first) / 1000 / args.speedup for r in rows]

    routes = None
    if args.replay_routes:
        routes = json.load(open(args.replay_routes))["routes"]
        if len(routes) < len(bodies):
            bodies = bodies[: len(routes)]
    base_for = (lambda i: routes[i] or args.url) if routes else (lambda i: args.url)

    stat0 = cpu_counters()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    if args.mode == "trace":
        records, t0, send_end, end, opened = asyncio.run(run_trace(args, bodies, offsets, base_for))
    else:
        records, t0, send_end, end, opened = asyncio.run(run_concurrency(args, bodies, base_for))
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    stat1 = cpu_counters()

    result = {
        "label": args.label,
        "mode": args.mode,
        "url": args.url,
        "trace": os.path.basename(args.trace),
        "skip": args.skip,
        "speedup": args.speedup if args.mode == "trace" else None,
        "concurrency": args.concurrency if args.mode == "concurrency" else None,
        "prompt_format": args.prompt_format,
        "max_prompt_tokens": args.max_prompt_tokens,
        "max_output_tokens": args.max_output_tokens,
        "prompt_tokens_mean": sum(prompt_tokens[: len(records)]) / max(1, len(records)),
        "max_tokens_mean": sum(max_tokens[: len(records)]) / max(1, len(records)),
        "bodies_built_s": built,
        "connections_opened": opened,
        # The replay's own CPU (not the bodies' building before it), and each CPU's busy share
        # over the replay (anything running on it: a saturated client CPU delays every answer).
        "client_cpu_s": ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime,
        "cpu_busy_pct": busy_pct(stat0, stat1),
        "client_process_cpu_s": ru1.ru_utime + ru1.ru_stime,
    } | summarize(records, t0, send_end, end)
    if args.record_routes:
        try:
            workers = fetch_json(args.url.rstrip("/") + "/workers")
            items = workers.get("workers", workers) if isinstance(workers, dict) else workers
            endpoint = {str(w["worker_id"]): w.get("endpoint") for w in items}
        except (OSError, ValueError, KeyError, TypeError) as e:
            endpoint = {}
            result["routes_error"] = f"GET /workers: {e}"
        result["routes"] = [endpoint.get(str(r.get("worker_id"))) for r in records]
    if args.per_request:
        result["per_request"] = [
            {k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items() if k != "start"}
            for r in records
        ]
    with open(args.out, "w") as f:
        json.dump(result, f)
    t, e = result["ttft_ms"], result["errors"]
    print(
        f"{args.label}: {result['ok']}/{result['requests']} ok, {e} errors, TTFT p50/p90/p99 "
        f"{t['p50']}/{t['p90']}/{t['p99']} ms, {result['throughput_rps']:.1f} req/s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
