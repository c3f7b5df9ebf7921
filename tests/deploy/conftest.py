"""Fixtures for the deployment tests: a live `tandem serve` with offloading on, and one with a MoE
model's hot-expert cache, as the dashboard and Prometheus see them. The server helpers live beside
the server tests (tests/server)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))  # tandem_server

from offloading import OFFLOADING_FLAGS, TWO_CORES, send_requests  # noqa: E402
from session_cache import own_expert_statistics  # noqa: E402
from tandem_server import ServerProcess, pipelining_cost_tables  # noqa: E402

# a dummy-weight MoE preset (up in seconds) with 2 of its 8 experts per layer in GPU slots
HOT_EXPERT_FLAGS = ("--model", "qwen3-moe-tiny", "--load-format", "dummy", "--hot-experts", "2")


@pytest.fixture(scope="session")
def offloading_server(tmp_path_factory) -> ServerProcess:
    """`tandem serve --device testbed` (offloading on) after requests that overflowed its GPU
    pool, so that every labelled series (tiers, plan modes, swap directions) exists."""
    if not TWO_CORES:
        pytest.skip("the testbed needs 2 cores")
    from engine.model_config import PRESET_DIR

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


@pytest.fixture(scope="module")
def hot_expert_server(tmp_path_factory) -> ServerProcess:
    """`tandem serve` on the tiniest MoE preset with its hot-expert cache on, before any request
    (module scope: a module that sends it requests does not share it). The offloading server's
    model is dense, so this is the server that exports the cache's per-layer, per-expert series;
    `--hot-experts 2` turns the cache on, which `auto` does only where a weight budget leaves the
    experts out. Its expert statistics are saved in its own directory, beside the session's measured
    profiles."""
    workdir = tmp_path_factory.mktemp("hot-experts")
    with own_expert_statistics(workdir / "profiles") as profiles:
        server = ServerProcess(workdir / "serve.log", *HOT_EXPERT_FLAGS, "--profile-cache-dir", str(profiles)).start()
        try:
            yield server
        finally:
            server.stop()
