"""Systems under test started from a command line: launch, wait for /health, stop.

A command is a shell-style string with `{port}` where the server's port goes, for instance
`tandem serve --port {port} --max-num-seqs 8` or `llama-server -m model.gguf --port {port}`.
It runs in its own process group on loopback so stopping it also stops any children it spawned.
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

HEALTH_POLL_S = 0.5
HEALTH_TIMEOUT_S = 2.0  # one /health probe; a loading server may not accept connections yet
STOP_TIMEOUT_S = 20.0
LOG_TAIL_CHARS = 3000


class SystemStartError(RuntimeError):
    """A system that would not start or stay up; the message carries its log's tail."""


@dataclass(frozen=True)
class SystemSpec:
    name: str
    command: str

    @classmethod
    def parse(cls, text: str) -> "SystemSpec":
        """`NAME=COMMAND` (the name labels curves and ratios)."""
        name, sep, command = text.partition("=")
        if not sep or not name.strip() or not command.strip():
            raise ValueError(f"a system is NAME=COMMAND, got '{text}'")
        if "{port}" not in command:
            raise ValueError(f"the command of system '{name}' needs a {{port}} placeholder")
        return cls(name.strip(), command.strip())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RunningSystem:
    """A started system; use as a context manager so it is always stopped."""

    def __init__(self, spec: SystemSpec, log_path: Path, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1") -> None:
        """`host`: where the system listens (a network namespace's address, for one started in it)."""
        self.spec = spec
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, startup_timeout_s: float) -> "RunningSystem":
        argv = shlex.split(self.spec.command.replace("{port}", str(self.port)))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            try:
                self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                             start_new_session=True)
            except OSError as exc:
                raise SystemStartError(f"cannot start system '{self.spec.name}' ({argv[0]}): {exc}") from None
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemStartError(f"system '{self.spec.name}' exited with {self.proc.returncode} while "
                                   f"starting:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=HEALTH_TIMEOUT_S).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(HEALTH_POLL_S)
        self.stop()
        raise SystemStartError(f"system '{self.spec.name}' not healthy after {startup_timeout_s:g} s:\n"
                           f"{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the process group, then SIGKILL if it has not exited in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> "RunningSystem":
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()
