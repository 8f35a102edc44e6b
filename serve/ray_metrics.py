"""One Prometheus exposition out of many replicas' (the Ray Serve scale-out's ``/metrics``).

Each engine replica keeps its own ``ServerMetrics`` (a private registry) and reports its text to
the application's metrics board every few seconds; the ingress merges the latest reports of the
replicas still reporting. Every sample gets a ``replica`` label instead of being summed here: a
replica that dies or restarts then looks to Prometheus like any target that went away (its
counters are not folded into another's and never run backwards), and ``sum without (replica)``
gives the fleet's totals. Needs only prometheus_client, not Ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REPLICA_LABEL = "replica"


@dataclass(frozen=True)
class ReplicaReport:
    """What one engine replica last said about itself."""

    replica: str
    """Ray Serve's replica tag (unique within the application)."""
    exposition: str
    """The replica's own ``/metrics`` text."""
    serving: bool
    """Its engine admits requests."""
    running: int
    waiting: int


def fleet_exposition(reports: list[ReplicaReport], own: Iterable[Metric] = ()) -> bytes:
    """The ingress' ``/metrics``: every replica's metrics, labelled by replica, the fleet's
    gauges and the ingress' ``own`` metrics."""
    merged = merge_expositions({report.replica: report.exposition for report in reports})
    return render([*merged, *fleet_gauges(reports), *own])


def merge_expositions(reports: Mapping[str, str]) -> list[Metric]:
    """Replica tag -> exposition text  ==>  metric families, each sample labelled by replica.

    A metric family that several replicas export (all of them do) appears once, with one
    series per replica and label set."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(reports.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                labels = {**sample.labels, REPLICA_LABEL: replica}
                merged.samples.append(
                    Sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
                )
    return list(families.values())


def fleet_gauges(reports: list[ReplicaReport]) -> list[Metric]:
    """Gauges the ingress adds about the fleet itself: replicas reporting, and serving."""
    reporting = GaugeMetricFamily(
        "selfspec_replicas_reporting", "Engine replicas whose last report is recent"
    )
    reporting.add_metric([], len(reports))
    serving = GaugeMetricFamily(
        "selfspec_replicas_serving", "Engine replicas reporting an engine that admits requests"
    )
    serving.add_metric([], sum(report.serving for report in reports))
    return [reporting, serving]


def render(families: Iterable[Metric]) -> bytes:
    """The exposition text of already collected metric families."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families)))
    return generate_latest(registry)


class _Fixed:
    """A collector that yields the families it was given."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


__all__ = [
    "REPLICA_LABEL",
    "ReplicaReport",
    "fleet_exposition",
    "fleet_gauges",
    "merge_expositions",
    "render",
]
