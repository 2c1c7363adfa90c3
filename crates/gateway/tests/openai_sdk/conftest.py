"""The gateway in front of mock engines, as processes, for the official `openai` SDK's tests.

`kvroute` is $KVROUTE_BIN, else target/debug/kvroute of the repository (scripts/test.sh builds
it before running these tests). Everything listens on 127.0.0.1, on ports the OS picked; every
process is stopped at the end of the session.
"""

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
KVROUTE = os.environ.get("KVROUTE_BIN", str(REPO / "target" / "debug" / "kvroute"))
MODEL = "default"
# Longest a fixture waits for a process to come up.
START_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def post_json(url: str, body: dict):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.status


def active_bookings(base: str) -> int:
    """Live bookings of every worker, from the service's `GET /loads`."""
    return sum(
        load["active_requests"] for partition in get_json(f"{base}/loads") for load in partition["loads"]
    )


def wait_until(what: str, check, timeout_s: float = START_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting: {what}")
        time.sleep(0.05)


class Fleet:
    """Mock engines and a gateway in front of them."""

    def __init__(self, engines: int = 2, engine_flags=(), gateway_flags=()):
        if not Path(KVROUTE).exists():
            raise FileNotFoundError(f"{KVROUTE} is missing: build it (cargo build -p kvroute) or set KVROUTE_BIN")
        self.processes = []
        workers = []
        for _ in range(engines):
            port, events = free_port(), free_port()
            self.spawn(
                "fake-engine", "--openai", "--port", str(port), "--bind", f"tcp://127.0.0.1:{events}",
                "--time-scale", "0.01", *engine_flags,
            )
            url = f"http://127.0.0.1:{port}"
            wait_until(f"engine {url}", lambda: get_json(f"{url}/v1/models")["data"])
            workers += ["--worker", f"{url}=tcp://127.0.0.1:{events}"]
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.spawn(
            "gateway", "--port", str(self.port), "--tokenize", "remote", "--health-check-secs", "0",
            *workers, *gateway_flags,
        )
        wait_until("the gateway", lambda: len(get_json(f"{self.base}/v1/models")["data"]) > 0)

    def spawn(self, *args):
        process = subprocess.Popen(
            [KVROUTE, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.processes.append(process)

    def stop(self):
        for process in reversed(self.processes):
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="session")
def fleet():
    fleet = Fleet()
    yield fleet
    fleet.stop()
