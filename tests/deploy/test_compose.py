"""docker/compose.yaml wires what the repository ships: every file it mounts exists, Prometheus
scrapes the tandem service on the port the image listens on, Grafana's datasource is the
Prometheus service, and the dashboard is mounted where the provisioning looks for it. (Running
the stack needs Docker and its registry images; test_prometheus.py runs the scrape config.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dockerfiles import DOCKER_DIR, DOCKERFILES, ROOT, stages

COMPOSE = DOCKER_DIR / "compose.yaml"
PROMETHEUS_CONFIG = ROOT / "configs" / "prometheus" / "prometheus.yml"
PROVISIONING = ROOT / "configs" / "grafana" / "provisioning"


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def bind_mounts(service: dict) -> dict[str, Path]:
    """Container path -> the repository file a service mounts there (relative to docker/)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[target] = (DOCKER_DIR / source).resolve()
    return mounts


def image_port() -> str:
    env = " ".join(stages(DOCKERFILES["cpu"])[-1].arguments("ENV"))
    return env.split("TANDEM_PORT=")[1].split()[0]


def test_every_mounted_file_is_in_the_repository(services):
    mounts = [path for service in services.values() for path in bind_mounts(service).values()]
    assert len(mounts) == 3
    for path in mounts:
        assert path.exists() and ROOT in path.parents, path


def test_tandem_is_built_from_the_cpu_dockerfile_and_published_on_its_port(services):
    build = services["tandem"]["build"]
    assert (DOCKER_DIR / build["context"]).resolve() == ROOT
    assert (ROOT / build["dockerfile"]).resolve() == DOCKERFILES["cpu"]
    assert services["tandem"]["ports"] == [f"{image_port()}:{image_port()}"]


def test_prometheus_scrapes_the_tandem_service_with_the_shipped_config(services):
    prometheus = services["prometheus"]
    config_flag = next(arg for arg in prometheus["command"] if arg.startswith("--config.file="))
    assert bind_mounts(prometheus)[config_flag.split("=", 1)[1]] == PROMETHEUS_CONFIG
    (job,) = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": [f"tandem:{image_port()}"]}]


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard(services):
    grafana = services["grafana"]
    mounts = bind_mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == PROVISIONING
    (datasource,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    prometheus_port = services["prometheus"]["ports"][0].split(":")[1]
    assert datasource["url"] == f"http://prometheus:{prometheus_port}" and datasource["uid"] == "prometheus"
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "tandem.yml").read_text())["providers"]
    dashboard_target = next(target for target, path in mounts.items() if path.name == "tandem.json")
    assert Path(dashboard_target).parent == Path(provider["options"]["path"])
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard_target


def test_the_server_is_started_again_when_it_exits_on_failure(services):
    """A dead engine loop ends `tandem serve` with exit code 1; the supervisors restart it."""
    assert services["tandem"]["restart"] in ("unless-stopped", "always", "on-failure")
    unit = (ROOT / "docs" / "deploy.md").read_text().split("# /etc/systemd/system/tandem.service")[1].split("```")[0]
    assert "\nRestart=on-failure\n" in unit
