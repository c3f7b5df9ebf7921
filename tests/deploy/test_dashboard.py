"""configs/grafana/tandem.json reads only what tandem exports: every metric name in its queries is a
series of a live `tandem serve` with offloading on (the testbed) but the hot-expert cache's (a dense
model has no experts), and every one is a series of a MoE `tandem serve` with the cache on that has
served nothing yet; every label it filters or groups by is on those series, and every metric either
server exports has a panel."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from promql import all_panels, dashboard_expressions, load_dashboard, names_in, template_queries

DATASOURCE_UID = "prometheus"  # configs/grafana/provisioning/datasources/prometheus.yml
GRID_COLUMNS = 24
HOT_EXPERT_PREFIX = "tandem:moe_"  # the hot-expert cache's families: a MoE model's alone


def exported_series(url: str) -> dict[str, dict[str, set[str]]]:
    """/metrics of the server at `url`: each metric family -> its sample names -> the label names
    their series carry."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    families: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        samples = families.setdefault(family.name, {})
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    return families


def merged(*exports: dict[str, dict[str, set[str]]]) -> dict[str, dict[str, set[str]]]:
    """The families of several servers' /metrics, each sample's label names united."""
    families: dict[str, dict[str, set[str]]] = {}
    for export in exports:
        for family, samples in export.items():
            for name, labels in samples.items():
                families.setdefault(family, {}).setdefault(name, set()).update(labels)
    return families


@pytest.fixture(scope="module")
def exported(offloading_server):
    return exported_series(offloading_server.url)


@pytest.fixture(scope="module")
def fresh_exported(hot_expert_server):
    """/metrics of the MoE server with its hot-expert cache on, which has served nothing."""
    return exported_series(hot_expert_server.url)


def dashboard_metrics() -> set[str]:
    return set().union(*(names_in(expr).metrics for expr in dashboard_expressions(load_dashboard())))


def assert_dashboard_reads_only(exported: dict[str, dict[str, set[str]]]) -> None:
    """Every metric the dashboard's queries read is a series in `exported`, with the labels they use."""
    series_labels = {name: labels for samples in exported.values() for name, labels in samples.items()}
    queries = [(expr, names_in(expr)) for expr in dashboard_expressions(load_dashboard())]
    queries += [(f"variable {q.metrics}", q) for q in template_queries(load_dashboard())]
    assert len(queries) > 20
    for expr, names in queries:
        missing = sorted(names.metrics - set(series_labels))
        assert not missing, f"{expr}: not exported by a live tandem serve: {missing}"
        assert names.metrics, f"{expr}: reads no metric"
        labels_there = set().union(*(series_labels[name] for name in names.metrics))
        stray = sorted(names.labels - labels_there)
        assert not stray, f"{expr}: labels {stray} are on none of its series"


def test_names_come_out_of_promql_without_functions_or_labels():
    names = names_in('histogram_quantile(0.9, sum by (le) (rate(tandem:ttft_bucket{model_name=~"$m"}[5m]))) '
                     '/ on(tier) group_left(mode) max(tandem:usage) > bool 1e3')
    assert names.metrics == {"tandem:ttft_bucket", "tandem:usage"}
    assert names.labels == {"le", "model_name", "tier", "mode"}


def test_every_dashboard_metric_is_a_live_series_with_the_labels_it_uses(exported, fresh_exported):
    """The offloading server exports every metric the dashboard reads but the hot-expert cache's,
    which the MoE server exports."""
    assert_dashboard_reads_only(merged(exported, fresh_exported))
    offloading = {name for samples in exported.values() for name in samples}
    read = dashboard_metrics()
    assert all(name.startswith(HOT_EXPERT_PREFIX) for name in read - offloading), sorted(read - offloading)


def test_a_server_that_served_nothing_already_exports_every_dashboard_metric(fresh_exported):
    """Labelled metrics export nothing until `.labels()` is called: tandem calls it at start with
    every known label value, so a fresh dashboard shows 0 rather than "No data". The server runs
    a MoE model with its hot-expert cache on, so the cache's per-layer, per-expert series exist too."""
    assert_dashboard_reads_only(fresh_exported)


def test_every_exported_metric_has_a_panel(exported, fresh_exported):
    read = dashboard_metrics()
    tandem_families = {name: samples for name, samples in merged(exported, fresh_exported).items()
                       if name.startswith("tandem:")}
    assert len(tandem_families) > 20
    without_panel = sorted(name for name, samples in tandem_families.items() if not read & set(samples))
    assert not without_panel, f"exported but on no panel: {without_panel}"


def test_the_layout_is_a_grafana_dashboard_on_the_provisioned_datasource():
    dashboard = load_dashboard()
    panels = all_panels(dashboard)
    assert dashboard["uid"] == "tandem" and dashboard["title"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    rows = [panel["title"] for panel in panels if panel["type"] == "row"]
    assert rows == ["Serving", "Prefix cache", "Offloading (Neo)", "Weights", "Hot experts (MoE)",
                    "Speculative decoding"]
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        cell = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])}
        assert not cell & cells, f"{panel['title']} overlaps another panel"
        cells |= cell
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == DATASOURCE_UID and panel["targets"], panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        assert all(target["datasource"]["uid"] == DATASOURCE_UID for target in panel["targets"])
