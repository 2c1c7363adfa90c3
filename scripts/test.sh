#!/usr/bin/env bash
# Runs every kvroute test: Rust unit, property and integration tests, then the Python binding's
# pytest suite. This is the README's test command; .ci/run calls it. It installs what the tests
# need first, so it passes on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/deps.sh # nats-server and chromium, when missing (Debian packages)

# Python binding (crates/py): build the kvroute wheel with maturin (debug profile: quick to build,
# and the tests do not need speed), install it into a virtualenv and run its pytest suite; then
# the gateway driven by the official `openai` SDK (crates/gateway/tests/openai_sdk). The
# virtualenv is $KVROUTE_PY_VENV or ./.venv when one exists there, else a new ./.venv. Its
# packages install from the network while the Rust tests build and run.
py_venv=""
for candidate in "${KVROUTE_PY_VENV:-}" .venv; do
    if [ -n "$candidate" ] && [ -x "$candidate/bin/python" ]; then
        py_venv="$candidate"
        break
    fi
done
if [ -z "$py_venv" ]; then
    py_venv=.venv
    python3 -m venv "$py_venv"
fi
py="$(cd "$py_venv" && pwd)/bin/python"
"$py" -m pip install --quiet --disable-pip-version-check \
    maturin pytest pytest-asyncio pyzmq msgspec numpy openai &
pip_pid=$!
trap 'kill "$pip_pid" 2>/dev/null || true' EXIT

cargo test --workspace --all-targets --locked
echo "== scripts/test.sh: Rust tests passed at ${SECONDS} s"
cargo test --workspace --doc --locked
echo "== scripts/test.sh: doc tests passed at ${SECONDS} s"
bash scripts/readme_example.sh # the README's "Try it", verbatim, on target/debug/kvroute

if ! wait "$pip_pid"; then
    echo "installing the Python test dependencies (maturin, pytest, ...) failed" >&2
    exit 1
fi
trap - EXIT
rm -rf target/py/wheels
# Its own target dir (maturin's PYO3_* environment would make pyo3 rebuild in turn with the Rust
# tests); no debug info, which a test wheel does not need and which costs a fifth of the build.
CARGO_TARGET_DIR=target/py CARGO_PROFILE_DEV_DEBUG=0 "$py" -m maturin build --locked \
    --manifest-path crates/py/Cargo.toml --out target/py/wheels
echo "== scripts/test.sh: wheel built at ${SECONDS} s"
"$py" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps \
    target/py/wheels/kvroute-*.whl
pytest_status=0
(cd crates/py && "$py" -m pytest -p no:cacheprovider) || pytest_status=$?
if [ "$pytest_status" -ne 0 ]; then
    # 5: pytest collected no tests, which must not pass for a green run either.
    echo "crates/py pytest failed (exit $pytest_status)" >&2
    exit "$pytest_status"
fi
# The gateway and mock engines as processes (target/debug/kvroute, built by the Rust tests),
# driven by the openai SDK.
sdk_status=0
(cd crates/gateway/tests/openai_sdk && "$py" -m pytest -p no:cacheprovider) || sdk_status=$?
if [ "$sdk_status" -ne 0 ]; then
    echo "crates/gateway/tests/openai_sdk pytest failed (exit $sdk_status)" >&2
    exit "$sdk_status"
fi
