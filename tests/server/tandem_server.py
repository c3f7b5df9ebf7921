"""Helpers for the server tests: a `tandem serve` subprocess, /metrics scraping, error shape,
the /openapi.json document."""
from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from offload_costs import cost_tables  # tests/ is on sys.path through tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
STARTUP_TIMEOUT_S = 120.0  # imports + weight load take 10-20 s; slow CI machines get headroom
STOP_TIMEOUT_S = 20.0
IDLE_TIMEOUT_S = 20.0
REQUEST_TIMEOUT_S = 60.0
# Flags added to every server the tests start: run the server suites in another mode, e.g. with
# the weights streamed (TANDEM_TEST_SERVE_FLAGS="--weights-gpu-gib 0.2 --offload-dir /some/dir").
EXTRA_FLAGS_ENV = "TANDEM_TEST_SERVE_FLAGS"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the test process dies, so a killed suite (out of
    memory, a timeout) leaves no server holding gigabytes behind. Linux only; elsewhere nothing."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerProcess:
    """A `tandem serve` subprocess; `start()` returns once /health answers 200."""

    def __init__(self, log_path: Path, *flags: str, env: dict[str, str] | None = None,
                 entry: tuple[str, ...] = ("-m", "server.cli"), host: str = "127.0.0.1",
                 prefix: tuple[str, ...] = ()) -> None:
        """`entry`: what python runs with `serve` and the flags (a script that plants faults, say);
        `host`: the address it listens on; `prefix`: a command that runs it (in a network namespace,
        say: `ip netns exec NAME`)."""
        self.entry, self.prefix = entry, prefix
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        self.flags = ("--host", host, "--port", str(self.port), "--dtype", "float32", *flags,
                      *os.environ.get(EXTRA_FLAGS_ENV, "").split())
        # the server refuses TANDEM_* variables it has no flag for: the suite's own stays here
        inherited = {k: v for k, v in os.environ.items() if k != EXTRA_FLAGS_ENV}
        self.env = {**inherited, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([*self.prefix, sys.executable, *self.entry, "serve", *self.flags],
                                         cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=die_with_parent)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"tandem serve not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log_tail()}")

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        self.wait_stopped()

    def wait_stopped(self) -> None:
        """After SIGTERM: its exit, killed if it takes longer than STOP_TIMEOUT_S."""
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]


def rank_pids(server: ServerProcess, kind: str = "tensor-parallel rank") -> dict[int, int]:
    """rank (or with kind "pipeline stage", stage) -> pid of a parallel server's actors, from its log."""
    found = re.findall(rf"{kind} (\d+): pid (\d+)", server.log_tail(10**6))
    return {int(rank): int(pid) for rank, pid in found}


# ---- offloading ---------------------------------------------------------------------------
# A memory-bound GPU and a cheap CPU attention, so the pipelined plan wins often: the engine
# tests' tables (tests/offload_costs.py), kept under the name the server tests know them by.
pipelining_cost_tables = cost_tables


# ---- /metrics -----------------------------------------------------------------------------
def scrape(http: httpx.Client) -> dict[tuple, float]:
    """Samples of /metrics keyed by (name, sorted labels other than model_name)."""
    response = http.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def metric(samples: dict[tuple, float], name: str, **labels: str) -> float:
    return samples.get((f"tandem:{name}", tuple(sorted(labels.items()))), 0.0)


def wait_idle(http: httpx.Client, timeout: float = IDLE_TIMEOUT_S) -> dict[tuple, float]:
    """Poll /metrics until nothing runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(http)
        busy = {name: metric(samples, name) for name in
                ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
        if not any(busy.values()):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: {busy}")
        time.sleep(0.1)


def greedy_completion(http: httpx.Client, prompt: str, max_tokens: int) -> str:
    """The embedded model's greedy completion of exactly `max_tokens` tokens (ignore_eos), its text."""
    response = http.post("/v1/completions", json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """The body is OpenAI's error shape; returns the inner error object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- /openapi.json ------------------------------------------------------------------------
def openapi_document(*api_keys: str) -> dict:
    """The document a server with `api_keys` serves, from an app around a stand-in engine: the
    document needs only the routes, so no model is loaded."""
    # imported here: the other helpers stay free of torch, which the app's modules import
    from server.app import create_app
    from server.context import ServerSettings

    stand_in = SimpleNamespace(engine=SimpleNamespace(tokenizer=None))
    app = create_app(stand_in, ServerSettings(MODEL, api_keys=api_keys), metrics=None)
    return app.openapi()


def stop_all(servers: list[ServerProcess]) -> None:
    """SIGTERM to every running server at once, then each one's exit: they drain side by side."""
    running = [server for server in servers if server.proc is not None and server.proc.poll() is None]
    for server in running:
        server.proc.send_signal(signal.SIGTERM)
    for server in running:
        server.wait_stopped()
