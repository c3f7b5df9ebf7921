"""Faults injected into a live `tandem serve` (tests/server/faulty_server.py plants them): a request
whose sampling raises fails alone (500, OpenAI's error shape) while requests beside it finish; the
engine loop itself raising makes /health answer 503 with the reason, then the process exits 1 after
--dead-engine-grace, for its supervisor to start it again."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from faulty_server import LOOP_FAULT_TOKEN, SAMPLING_FAULT_TOKEN
from tandem_server import MODEL, REQUEST_TIMEOUT_S, ServerProcess, assert_openai_error

pytestmark = pytest.mark.integration
GRACE_S = 3.0
FAULTY_SERVER = (str(Path(__file__).resolve().parent / "faulty_server.py"),)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("faults") / "server.log"
    server = ServerProcess(log, "--dead-engine-grace", str(GRACE_S), entry=FAULTY_SERVER).start()
    try:
        yield server
    finally:
        server.stop()


def complete(server: ServerProcess, prompt: list[int]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})


def test_a_request_whose_sampling_fails_fails_alone(server):
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, SAMPLING_FAULT_TOKEN, 9], [10, 11, 12, 13, 14]]
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda prompt: complete(server, prompt), prompts))
    failed = responses.pop(2)
    assert "sampling failed" in assert_openai_error(failed, 500)["message"]
    for response in responses:
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert httpx.get(f"{server.url}/health", timeout=5.0).status_code == 200


def test_a_dead_engine_loop_turns_health_to_503_then_exits_1(server):
    """Last in the module: the server does not survive it."""
    response = complete(server, [1, LOOP_FAULT_TOKEN, 2])
    assert response.status_code == 503, response.text
    health = httpx.get(f"{server.url}/health", timeout=5.0)
    assert "a fault planted in the engine loop" in assert_openai_error(health, 503)["message"]
    start = time.monotonic()
    assert server.wait(timeout=GRACE_S + 20) == 1
    assert time.monotonic() - start <= GRACE_S + 20
    log = server.log_tail()
    assert "engine loop died" in log and "a fault planted in the engine loop" in log
