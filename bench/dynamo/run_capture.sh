#!/usr/bin/env bash
# Capture Dynamo selection-service fixtures inside a loopback-only network namespace.
# Dynamo's service binds 0.0.0.0 with no option to change it, so it only ever runs in `kvns`,
# a namespace whose only interface is `lo`. Needs root (ip netns).
#
#   python3 -m venv /work/venv-dynamo && /work/venv-dynamo/bin/pip install ai-dynamo-runtime==1.6.1
#   bench/dynamo/run_capture.sh            # all scenarios
#   bench/dynamo/run_capture.sh errors     # some scenarios (python_api = capture_pyapi.py)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
py="${DYNAMO_PYTHON:-/work/venv-dynamo/bin/python}"
out="$repo/crates/service/tests/fixtures/dynamo"
ns=kvns
created=0
if ! ip netns list | grep -qw "$ns"; then
  ip netns add "$ns"
  created=1
fi
cleanup() { if [ "$created" = 1 ]; then ip netns del "$ns"; fi; }
trap cleanup EXIT
ip netns exec "$ns" ip link set lo up
# Scenario names select capture.py scenarios; "python_api" selects capture_pyapi.py. No names: all.
only=()
pyapi=1
if [ "$#" -gt 0 ]; then
  pyapi=0
  for s in "$@"; do
    if [ "$s" = python_api ]; then pyapi=1; else only+=("$s"); fi
  done
fi
if [ "$#" -eq 0 ] || [ "${#only[@]}" -gt 0 ]; then
  args=()
  if [ "${#only[@]}" -gt 0 ]; then args=(--only "${only[@]}"); fi
  ip netns exec "$ns" python3 "$here/capture.py" --dynamo-python "$py" --out "$out" "${args[@]}"
fi
if [ "$pyapi" = 1 ]; then
  ip netns exec "$ns" "$py" "$here/capture_pyapi.py" --out "$out/python_api.json"
fi
