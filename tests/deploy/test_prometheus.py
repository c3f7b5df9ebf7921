"""Prometheus itself (Debian's `prometheus` package) against tandem: promtool accepts the shipped
scrape config and parses every dashboard query; a real Prometheus scrapes a live offloading
`tandem serve` and a MoE one with its hot-expert cache on (whose per-layer, per-expert series a
dense model does not have) on loopback, answers a query for a tandem metric with its value, and
evaluates every dashboard query to a non-empty result. `make test-integration` installs the package."""
from __future__ import annotations

import shutil
import subprocess
import threading
import time

import httpx
import pytest
import yaml

from offloading import send_requests
from promql import DASHBOARD_PATH, ROOT, dashboard_expressions, grafana_variables_replaced, load_dashboard
from tandem_server import free_port

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("promtool") is None or shutil.which("prometheus") is None,
                                 reason="Prometheus is not installed: `make test-integration` apt-installs it")]

PROMETHEUS_CONFIG = ROOT / "configs" / "prometheus" / "prometheus.yml"
SCRAPE_INTERVAL = "1s"  # the shipped 5s, shortened so the test waits seconds, not a minute
RATE_WINDOW = "20s"  # $__rate_interval: several scrapes
STARTUP_TIMEOUT_S = 60.0
SCRAPE_TIMEOUT_S = 60.0
MIN_SCRAPES = 10
NUM_TARGETS = 2  # the offloading server and the hot-expert one


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_shipped_scrape_config():
    result = promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_promtool_parses_every_dashboard_query(tmp_path):
    """As recording rules, which promtool parses with Prometheus's own PromQL parser."""
    expressions = dashboard_expressions(load_dashboard())
    rules = [{"record": f"dashboard:query_{i}", "expr": grafana_variables_replaced(expr, RATE_WINDOW)}
             for i, expr in enumerate(expressions)]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": DASHBOARD_PATH.name, "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(expressions)} rules found" in result.stdout


def scrape_config_for(targets: list[str]) -> dict:
    """The shipped config with its targets moved to `targets` and a shorter interval."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = SCRAPE_INTERVAL
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": targets}]
    return config


@pytest.fixture(scope="module")
def prometheus(offloading_server, hot_expert_server, tmp_path_factory) -> str:
    """A Prometheus scraping `offloading_server` and `hot_expert_server`; its URL."""
    workdir = tmp_path_factory.mktemp("prometheus")
    config = workdir / "prometheus.yml"
    targets = [f"127.0.0.1:{server.port}" for server in (offloading_server, hot_expert_server)]
    config.write_text(yaml.safe_dump(scrape_config_for(targets)))
    url = f"http://127.0.0.1:{free_port()}"
    log = open(workdir / "prometheus.log", "wb")
    proc = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address={url.removeprefix('http://')}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _ready(url), STARTUP_TIMEOUT_S, f"Prometheus not ready; log: {workdir / 'prometheus.log'}")
        yield url
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


def wait_until(condition, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.5)


def query(prometheus_url: str, expression: str) -> list[dict]:
    response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expression}, timeout=10.0)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", f"{expression}: {body}"
    return body["data"]["result"]


@pytest.fixture(scope="module")
def under_load(prometheus, offloading_server):
    """Requests keep arriving while Prometheus scrapes, until the module's tests are done."""
    stop = threading.Event()

    def keep_sending():
        while not stop.is_set():
            send_requests(offloading_server.url)

    sender = threading.Thread(target=keep_sending, daemon=True)
    sender.start()
    wait_until(lambda: _num_scrapes(prometheus) >= MIN_SCRAPES, SCRAPE_TIMEOUT_S,
               f"Prometheus did not scrape tandem {MIN_SCRAPES} times in {SCRAPE_TIMEOUT_S} s")
    yield prometheus
    stop.set()
    sender.join(120)


def _num_scrapes(prometheus_url: str) -> int:
    """The scrapes of the target scraped least (0 until each has been scraped)."""
    if len(query(prometheus_url, 'up{job="tandem"}')) < NUM_TARGETS:
        return 0
    result = query(prometheus_url, f'min(count_over_time(up{{job="tandem"}}[{RATE_WINDOW}]))')
    return int(float(result[0]["value"][1])) if result else 0


def test_prometheus_scrapes_tandem_and_answers_with_its_value(under_load, offloading_server):
    ups = query(under_load, 'up{job="tandem"}')
    assert [up["value"][1] for up in ups] == ["1"] * NUM_TARGETS
    (tokens,) = query(under_load, 'tandem:generation_tokens_total{model_name="smollm2-135m"}')
    assert tokens["metric"]["model_name"] == "smollm2-135m"
    exported = httpx.get(f"{offloading_server.url}/metrics").text
    assert float(tokens["value"][1]) > 0 and "tandem:generation_tokens_total" in exported


def test_every_dashboard_query_has_data(under_load):
    empty = [expr for expr in dashboard_expressions(load_dashboard())
             if not query(under_load, grafana_variables_replaced(expr, RATE_WINDOW))]
    assert not empty, f"no data for: {empty}"
