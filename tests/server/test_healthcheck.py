"""`python -m server.healthcheck` (the images' HEALTHCHECK): 0 while a server answers /health on
$TANDEM_PORT, 1 with the reason when nothing listens there."""
from __future__ import annotations

import os
import subprocess
import sys

from tandem_server import ROOT, free_port


def healthcheck(port: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.healthcheck"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TANDEM_PORT": str(port)}, timeout=30)


def test_a_serving_server_is_healthy(server):
    result = healthcheck(server.port)
    assert result.returncode == 0, result.stderr


def test_nothing_listening_is_unhealthy():
    port = free_port()
    result = healthcheck(port)
    assert result.returncode == 1
    assert f"unhealthy: http://127.0.0.1:{port}/health" in result.stderr
