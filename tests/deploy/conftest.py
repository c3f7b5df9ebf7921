"""Fixtures for the deployment tests: a live `tandem serve` with offloading on, as the dashboard
and Prometheus see it. The server helpers live beside the server tests (tests/server)."""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))  # tandem_server

from tandem_server import REQUEST_TIMEOUT_S, ServerProcess, pipelining_cost_tables  # noqa: E402

TWO_CORES = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2
PROMPTS = [f"Count from {i} to {i + 20}, one number per line:" for i in range(8)]
MAX_TOKENS = 32
# 8 blocks of 16 tokens hold about two of these requests: the rest go to the host pool
OFFLOADING_FLAGS = ("--device", "testbed", "--num-gpu-blocks", "8", "--num-cpu-blocks", "256",
                    "--max-model-len", "128")


def send_requests(url: str, prompts: list[str] = PROMPTS) -> list[str]:
    """Completions for `prompts`, all at once; their texts."""
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        def complete(prompt: str) -> str:
            response = http.post("/v1/completions", json={
                "model": "smollm2-135m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True})
            response.raise_for_status()
            return response.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(complete, prompts))


@pytest.fixture(scope="session")
def offloading_server(tmp_path_factory) -> ServerProcess:
    """`tandem serve --device testbed` (offloading on) after requests that overflowed its accelerator
    pool, so that every labelled series (tiers, plan modes, swap directions) exists."""
    if not TWO_CORES:
        pytest.skip("the testbed needs 2 cores")
    from engine.model.config import PRESET_DIR

    num_layers = json.loads((PRESET_DIR / "smollm2-135m.json").read_text())["num_hidden_layers"]
    workdir = tmp_path_factory.mktemp("offloading")
    tables = workdir / "costs.json"
    tables.write_text(json.dumps(pipelining_cost_tables(num_layers)))
    server = ServerProcess(workdir / "serve.log", *OFFLOADING_FLAGS, "--cost-tables", str(tables)).start()
    try:
        send_requests(server.url)
        yield server
    finally:
        server.stop()
