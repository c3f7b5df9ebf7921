"""Fixtures that run the real `tandem serve` as a subprocess on a free loopback port.

One server serves the whole session; tests that need other flags (keys, tiny bounds) start
their own through `start_server`. Every wait is bounded in time.
"""
from __future__ import annotations

import httpx
import openai
import pytest

from tandem_server import REQUEST_TIMEOUT_S, ServerProcess, stop_all


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """Factory for extra servers with their own flags; all are stopped at session end."""
    started: list[ServerProcess] = []

    def start(*flags: str, env: dict[str, str] | None = None) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "serve.log"
        server = ServerProcess(log, *flags, env=env)
        started.append(server)
        return server.start()

    yield start
    stop_all(started)


@pytest.fixture(scope="session")
def server(start_server) -> ServerProcess:
    return start_server()


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
