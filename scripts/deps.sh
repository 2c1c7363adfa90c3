#!/usr/bin/env bash
# Installs the system programs the tests start, when they are missing: `nats-server` (the
# replica-sync tests run a real one) and `chromium` (the status page's test renders it headless).
# Both are Debian packages. Silent when both are present; scripts/test.sh runs it first.
set -euo pipefail

# Looks where the tests look: the $KVROUTE_* override, then the PATH, then the package's path
# (/usr/sbin is not on every non-root PATH).
have() { # have ENV_OVERRIDE PROGRAM PACKAGE_PATH
    local override="${!1:-}"
    [ -n "$override" ] && [ -x "$override" ] && return 0
    command -v "$2" >/dev/null 2>&1 && return 0
    [ -x "$3" ]
}

missing=()
have KVROUTE_NATS_SERVER nats-server /usr/sbin/nats-server || missing+=(nats-server)
have KVROUTE_CHROMIUM chromium /usr/bin/chromium || missing+=(chromium)
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$EUID" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    echo "scripts/deps.sh: the tests need ${missing[*]}; install as root:" \
        "apt-get install -y ${missing[*]}" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/deps.sh: the tests need ${missing[*]} (Debian packages of those names) and" \
        "this machine has no apt-get: install them, or point KVROUTE_NATS_SERVER and" \
        "KVROUTE_CHROMIUM at the binaries" >&2
    exit 1
fi

echo "== scripts/deps.sh: installing ${missing[*]}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! { "${as_root[@]}" apt-get update -qq &&
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq "${missing[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "scripts/deps.sh: installing ${missing[*]} failed (apt-get's output above)" >&2
    exit 1
fi
