#!/usr/bin/env bash
# Runs the README's "Try it" examples verbatim against a real `kvroute serve` and checks what
# they promise. scripts/test.sh calls it after the Rust tests.
#
# The shell blocks of the section are read from README.md at run time: the block with the
# `... -- serve` command starts the server, every other block is one example, run command by
# command in one shell, exactly as written. Only `cargo` is replaced, by a shell function that
# runs an already-built binary for `cargo run --release -p kvroute -- ARGS` (a release build
# would add minutes to CI): $KVROUTE_BIN, else ${CARGO_TARGET_DIR:-target}/debug/kvroute.
#
# Checks: every command exits with 0; no JSON answer is an `{"error": ...}`; and each
# `# → "key": value, ...` line holds for the output of the command above it: `{...}` around it
# (without the `...`) must match, key by key and nested objects alike, an object of that output.
#
# The examples use fixed ports (8000 for the server, 5557 for the fake engine): when one is
# taken the script fails rather than talk to another process. Every wait is bounded; the
# server and the examples' processes are killed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

bin="${KVROUTE_BIN:-${CARGO_TARGET_DIR:-target}/debug/kvroute}"
# The README assumes the defaults: no KVROUTE_* setting of the caller's may leak in.
while read -r name; do
    unset "$name"
done < <(compgen -e | grep '^KVROUTE_' || true)

not_run() {
    echo "readme example: not run: $*" >&2
    exit 1
}

[ -x "$bin" ] || not_run "no kvroute binary at $bin (build it: cargo build -p kvroute)"
bin="$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")"
for tool in python3 curl timeout setsid; do
    command -v "$tool" > /dev/null || not_run "$tool is not installed"
done

tmp="$(mktemp -d "${TMPDIR:-/tmp}/readme_example.XXXXXX")"
server_pid=""
examples_pid=""
cleanup() {
    # Each ran in a process group of its own (setsid): the group goes, children included.
    for pid in "$examples_pid" "$server_pid"; do
        if [ -n "$pid" ]; then
            kill -TERM -- "-$pid" 2> /dev/null || true
        fi
    done
    for pid in "$examples_pid" "$server_pid"; do
        if [ -n "$pid" ]; then
            wait "$pid" 2> /dev/null || true
        fi
    done
    rm -rf "$tmp"
}
trap cleanup EXIT

cat > "$tmp/readme_example.py" << 'PY'
"""Reads the README's "Try it" section into shell scripts; checks what the examples printed."""
import json
import re
import sys
from pathlib import Path


def fail(message):
    print(f"readme example: not run: {message}", file=sys.stderr)
    sys.exit(1)


def section(readme, title):
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    if not match:
        fail(f"README.md has no section '## {title}'")
    return match.group(1)


def commands(block):
    """A shell block's commands (continuation lines joined) and the promises after each."""
    out, pending = [], None
    for line in block.splitlines():
        stripped = line.strip()
        if pending is not None:
            pending += "\n" + line
            if not line.endswith("\\"):
                out.append({"text": pending, "promises": []})
                pending = None
            continue
        if not stripped:
            continue
        if stripped.startswith("# →"):
            if not out:
                fail(f"a promise before any command: {stripped}")
            out[-1]["promises"].append(stripped[len("# →"):].strip())
        elif stripped.startswith("#"):
            continue
        elif line.endswith("\\"):
            pending = line
        else:
            out.append({"text": line, "promises": []})
    if pending is not None:
        fail(f"a command ends in a continuation: {pending}")
    return out


def extract(readme_path, tmp):
    text = section(Path(readme_path).read_text(encoding="utf-8"), "Try it")
    blocks = re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)
    server = [b for b in blocks if re.search(r"-- serve\b", b)]
    examples = [commands(b) for b in blocks if b not in server]
    if len(server) != 1 or len(commands(server[0])) != 1:
        fail("'## Try it' must have one shell block with the one `-- serve` command")
    if not examples:
        fail("'## Try it' has no example blocks")
    for example in examples:
        for command in example:
            for promise in command["promises"]:
                parse_promise(promise)
    tmp = Path(tmp)
    (tmp / "serve.sh").write_text(
        f'. "{tmp}/prelude.sh"\n{commands(server[0])[0]["text"]}\n', encoding="utf-8"
    )
    driver = [f'. "{tmp}/prelude.sh"']
    for e, example in enumerate(examples):
        for c, command in enumerate(example):
            out = f'"{tmp}/out/{e}.{c}'
            driver.append(
                f"{{\n{command['text']}\n}} > {out}.out\" 2> {out}.err\" < /dev/null; "
                f"echo $? > {out}.rc\""
            )
    (tmp / "examples.sh").write_text("\n".join(driver) + "\n", encoding="utf-8")
    (tmp / "plan.json").write_text(json.dumps(examples), encoding="utf-8")
    ports = sorted({int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", text)})
    print(" ".join(map(str, ports)))


def parse_promise(promise):
    body = re.sub(r",\s*\.\.\.", "", promise).replace("...", "").strip()
    try:
        value = json.loads("{" + body + "}")
    except json.JSONDecodeError as e:
        fail(f"cannot read the promise `# → {promise}` as JSON members: {e}")
    return value


def same(expected, actual):
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            key in actual and same(value, actual[key]) for key, value in expected.items()
        )
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(expected) is type(actual) and expected == actual
    return expected == actual


def found(expected, actual):
    """Whether some object in `actual` (at any depth) matches `expected`."""
    if same(expected, actual):
        return True
    children = actual.values() if isinstance(actual, dict) else actual if isinstance(actual, list) else []
    return any(found(expected, child) for child in children)


def clip(text, limit=1500):
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + " …"


def check(tmp):
    tmp = Path(tmp)
    examples = json.loads((tmp / "plan.json").read_text(encoding="utf-8"))
    passed = failed = 0
    for e, example in enumerate(examples):
        problems = []
        for c, command in enumerate(example):
            base = tmp / "out" / f"{e}.{c}"
            rc_file, out_file, err_file = (Path(f"{base}.{kind}") for kind in ("rc", "out", "err"))
            shown = command["text"].splitlines()[0].strip()
            if not rc_file.exists():
                problems.append(f"$ {shown}\n  did not run (the examples timed out before it)")
                break
            rc = int(rc_file.read_text().strip() or "1")
            out = out_file.read_text(encoding="utf-8", errors="replace")
            err = err_file.read_text(encoding="utf-8", errors="replace")
            if rc != 0:
                problems.append(f"$ {shown}\n  exit status {rc}\n  stdout: {clip(out)}\n  stderr: {clip(err)}")
                continue
            try:
                answer = json.loads(out)
            except json.JSONDecodeError:
                answer = None
            if isinstance(answer, dict) and "error" in answer:
                problems.append(f"$ {shown}\n  answered an error: {clip(out)}")
                continue
            for promise in command["promises"]:
                if answer is None:
                    problems.append(f"$ {shown}\n  promises `{promise}` but its output is not JSON: {clip(out)}")
                elif not found(parse_promise(promise), answer):
                    problems.append(f"$ {shown}\n  promises: {promise}\n  printed:  {clip(out)}")
        name = f"readme example {e + 1} ({len(example)} commands, " \
            f"{sum(len(c['promises']) for c in example)} promises)"
        if problems:
            failed += 1
            print(f"{name}: FAILED")
            for problem in problems:
                print("  " + problem.replace("\n", "\n  "))
        else:
            passed += 1
            print(f"{name}: ok")
    print(f"readme example: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    {"extract": extract, "check": check}[sys.argv[1]](*sys.argv[2:])
PY

mkdir -p "$tmp/out" "$tmp/curl"
# `cargo run --release -p kvroute -- ARGS` runs the built binary with ARGS; nothing else does.
cat > "$tmp/prelude.sh" << EOF
cargo() {
    if [ "\$#" -lt 5 ] || [ "\$1 \$2 \$3 \$4 \$5" != "run --release -p kvroute --" ]; then
        echo "readme example: \\\`cargo \$*\\\` is not \\\`cargo run --release -p kvroute -- ARGS\\\`, the one form this script runs" >&2
        return 127
    fi
    shift 5
    "$bin" "\$@"
}
EOF
# Every curl of the examples is bounded in time (curl reads $CURL_HOME/.curlrc).
printf 'connect-timeout = 5\nmax-time = 20\n' > "$tmp/curl/.curlrc"

ports="$(python3 "$tmp/readme_example.py" extract README.md "$tmp")"
for port in $ports; do
    if timeout 2 bash -c "exec 3<> /dev/tcp/127.0.0.1/$port" 2> /dev/null; then
        not_run "127.0.0.1:$port is in use (another server?); the README's example needs it"
    fi
done

setsid bash "$tmp/serve.sh" > "$tmp/serve.log" 2>&1 < /dev/null &
server_pid=$!
# Ready once *this* server says it listens (so the examples never reach another process).
listening=""
for _ in $(seq 1 300); do
    if grep -q '^kvroute listening on ' "$tmp/serve.log"; then
        listening="$(grep -m1 '^kvroute listening on ' "$tmp/serve.log")"
        break
    fi
    kill -0 "$server_pid" 2> /dev/null || break
    sleep 0.1
done
if [ -z "$listening" ]; then
    echo "--- server log:" >&2
    tail -n 20 "$tmp/serve.log" >&2
    not_run "the README's \`kvroute serve\` did not start listening within 30 s"
fi
echo "readme example: $listening ($bin)"

examples_status=0
CURL_HOME="$tmp/curl" setsid timeout 120 bash "$tmp/examples.sh" > "$tmp/examples.log" 2>&1 < /dev/null &
examples_pid=$!
wait "$examples_pid" || examples_status=$?
examples_pid=""
if [ "$examples_status" -eq 124 ]; then
    echo "readme example: the examples did not finish within 120 s" >&2
fi
if ! kill -0 "$server_pid" 2> /dev/null; then
    echo "readme example: the server exited during the examples; its log:" >&2
    tail -n 20 "$tmp/serve.log" >&2
fi
python3 "$tmp/readme_example.py" check "$tmp"
