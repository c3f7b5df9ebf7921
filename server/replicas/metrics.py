"""/metrics with replicas: each replica's engine series under a `replica` label, beside the front
end's own (its API request counts), one family per name as Prometheus requires."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from server.metrics import Metrics

REPLICA_LABEL = "replica"
# The families the front end counts itself: requests reach the replicas through it, not over HTTP.
FRONT_END_FAMILIES = frozenset({"tandem:api_requests"})


class ReplicaMetrics:
    """The metrics object the server holds with replicas: it counts what the front end sees and
    renders the replicas' series, read from them at each scrape."""

    def __init__(self, model_name: str, read_replicas: Callable[[], list[tuple[int, bytes]]]) -> None:
        self.front = Metrics(model_name)
        self.read_replicas = read_replicas

    def record_api_request(self, endpoint: str, status: int) -> None:
        self.front.record_api_request(endpoint, status)

    def render(self) -> bytes:
        return merged_exposition(self.front.render(), self.read_replicas())


def merged_exposition(front: bytes, replicas: list[tuple[int, bytes]]) -> bytes:
    """One exposition: the front end's own families, and every other family from the replicas,
    each sample labelled with its replica's index (the front end's engine series are never set)."""
    merged = {family.name: family for family in text_string_to_metric_families(front.decode())
              if family.name in FRONT_END_FAMILIES}
    for index, text in replicas:
        for family in text_string_to_metric_families(text.decode()):
            if family.name in FRONT_END_FAMILIES:
                continue
            target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            target.samples += [Sample(s.name, {**s.labels, REPLICA_LABEL: str(index)}, s.value, s.timestamp,
                                      s.exemplar) for s in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)


class _Families:
    """A collector yielding fixed families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)
