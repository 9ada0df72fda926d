"""The control plane's state as Prometheus metrics: replicas, desired counts, the autoscaler's targets and decisions.

The supervisor and the autoscaler keep what they see and decide in the database (their
contract: a restarted one resumes from there): the supervisor each replica's state and
restart count (``replicas``), the autoscaler and the rollouts each revision's desired count
(``revisions``) and every decision with its rule (``scaling_decisions``). This module reads
that at each scrape, so the numbers are the ones the router and ``modelplane endpoints
status`` see, they survive a restart of either process, and neither needs a port of its own.
:func:`read_snapshot` does the reading, :func:`families` (pure) turns a snapshot into metric
families; names and labels are in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy import Engine

from cluster.protocol import Replica

#: Replica states that always get a series per active revision (0 when none is in them), so a
#: dashboard shows "0 ready" instead of no line.
REPLICA_STATES = ("starting", "ready", "unhealthy")


@dataclass(frozen=True)
class RevisionState:
    revision_id: str
    endpoint: str
    desired_replicas: int
    active: bool  # pending, ready, serving or draining: its replicas are kept running


@dataclass(frozen=True)
class EndpointState:
    """What the autoscaler works with for one serving endpoint (``autoscale.controller.sources.read_plans``)."""

    endpoint: str
    revision_id: str
    slo_p99_ms: float
    min_replicas: int
    max_replicas: int
    target_concurrency: float  # per replica, in requests: the target in effect now


@dataclass(frozen=True)
class DecisionState:
    """The newest autoscaler decision on one axis of one endpoint."""

    endpoint: str
    revision_id: str
    axis: str  # horizontal | vertical
    rule: str
    at_s: float  # UNIX seconds
    replicas: int | None
    target: float | None


@dataclass(frozen=True)
class Snapshot:
    revisions: tuple[RevisionState, ...] = ()
    replicas: tuple[Replica, ...] = ()
    endpoints: tuple[EndpointState, ...] = ()
    decisions: tuple[DecisionState, ...] = ()


def families(snapshot: Snapshot) -> list[Metric]:
    """The metric families of one snapshot.

    >>> from prometheus_client import CollectorRegistry, generate_latest
    >>> snap = Snapshot(revisions=(RevisionState("gec-r1", "gec", 2, True),),
    ...                 replicas=(Replica("gec-r1-0", "gec-r1", "http://127.0.0.1:1", True, "ready", 3),))
    >>> registry = CollectorRegistry()
    >>> registry.register(StateCollector(lambda: snap))
    >>> for line in generate_latest(registry).decode().splitlines():
    ...     if line.startswith(("modelplane_replicas{", "modelplane_replica_restarts", "modelplane_revision")):
    ...         print(line)
    modelplane_replicas{endpoint="gec",revision="gec-r1",state="ready"} 1.0
    modelplane_replicas{endpoint="gec",revision="gec-r1",state="starting"} 0.0
    modelplane_replicas{endpoint="gec",revision="gec-r1",state="unhealthy"} 0.0
    modelplane_replica_restarts_total{endpoint="gec",replica="gec-r1-0",revision="gec-r1"} 3.0
    modelplane_revision_desired_replicas{endpoint="gec",revision="gec-r1"} 2.0
    """
    endpoint_of = {r.revision_id: r.endpoint for r in snapshot.revisions}
    replicas = GaugeMetricFamily("modelplane_replicas", "Replicas by state, as the supervisor (or Kubernetes) "
                                 "last reported them.", labels=["endpoint", "revision", "state"])
    counts: dict[tuple[str, str, str], int] = {}
    for revision in snapshot.revisions:
        if revision.active:
            for state in REPLICA_STATES:
                counts[(revision.endpoint, revision.revision_id, state)] = 0
    for replica in snapshot.replicas:
        key = (endpoint_of.get(replica.revision_id, ""), replica.revision_id, replica.state)
        counts[key] = counts.get(key, 0) + 1
    for labels, count in sorted(counts.items()):
        replicas.add_metric(list(labels), count)
    restarts = CounterMetricFamily("modelplane_replica_restarts", "Restarts of each replica's process by its "
                                   "supervisor (crash or hang).", labels=["endpoint", "revision", "replica"])
    for replica in snapshot.replicas:
        restarts.add_metric([endpoint_of.get(replica.revision_id, ""), replica.revision_id, replica.replica_id],
                            replica.restarts)
    desired = GaugeMetricFamily("modelplane_revision_desired_replicas", "Replicas each active revision should have "
                                "(set by its rollout and by the autoscaler).", labels=["endpoint", "revision"])
    for revision in snapshot.revisions:
        if revision.active:
            desired.add_metric([revision.endpoint, revision.revision_id], revision.desired_replicas)
    return [replicas, restarts, desired, *_endpoint_families(snapshot.endpoints),
            *_decision_families(snapshot.decisions)]


def _endpoint_families(endpoints: Iterable[EndpointState]) -> list[Metric]:
    slo = GaugeMetricFamily("modelplane_endpoint_slo_p99_seconds", "The endpoint spec's p99 latency objective.",
                            labels=["endpoint"])
    low = GaugeMetricFamily("modelplane_autoscaler_min_replicas", "The fewest replicas the autoscaler keeps.",
                            labels=["endpoint"])
    high = GaugeMetricFamily("modelplane_autoscaler_max_replicas", "The most replicas the autoscaler starts "
                             "(the spec's, capped by what fits on the hardware).", labels=["endpoint"])
    target = GaugeMetricFamily("modelplane_autoscaler_target_concurrency", "Requests in flight each replica is "
                               "meant to hold: the horizontal axis's target, set by the vertical axis.",
                               labels=["endpoint", "revision"])
    for e in endpoints:
        slo.add_metric([e.endpoint], e.slo_p99_ms / 1000.0)
        low.add_metric([e.endpoint], e.min_replicas)
        high.add_metric([e.endpoint], e.max_replicas)
        target.add_metric([e.endpoint, e.revision_id], e.target_concurrency)
    return [slo, low, high, target]


def _decision_families(decisions: Iterable[DecisionState]) -> list[Metric]:
    replicas = GaugeMetricFamily("modelplane_autoscaler_decision_replicas", "The replica count of the newest "
                                 "horizontal decision, labelled with the rule that chose it.",
                                 labels=["endpoint", "revision", "rule"])
    target = GaugeMetricFamily("modelplane_autoscaler_decision_target_concurrency", "The per-replica target of "
                               "the newest vertical decision, labelled with its rule.",
                               labels=["endpoint", "revision", "rule"])
    at = GaugeMetricFamily("modelplane_autoscaler_decision_timestamp_seconds", "When the newest decision on each "
                           "axis was made (UNIX time).", labels=["endpoint", "axis"])
    for d in decisions:
        if d.axis == "horizontal" and d.replicas is not None:
            replicas.add_metric([d.endpoint, d.revision_id, d.rule], d.replicas)
        if d.axis == "vertical" and d.target is not None:
            target.add_metric([d.endpoint, d.revision_id, d.rule], d.target)
        at.add_metric([d.endpoint, d.axis], d.at_s)
    return [replicas, target, at]


def read_snapshot(engine: Engine, replicas: Iterable[Replica], hardware_profile: str) -> Snapshot:
    """The rows :func:`families` needs, read now; ``replicas`` from the cluster backend."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from autoscale.controller.sources import read_plans
    from autoscale.vertical import held_target
    from cluster.local.backend import ACTIVE_STATES
    from controlplane.scaling import AXES, ScalingStore
    from controlplane.schema import RevisionRow

    with Session(engine) as session:
        revisions = tuple(RevisionState(row.id, row.endpoint, row.desired_replicas, row.state in ACTIVE_STATES)
                          for row in session.scalars(select(RevisionRow)))
    plans = read_plans(engine, hardware_profile)
    endpoints = tuple(EndpointState(p.endpoint, p.revision_id, p.slo_p99_ms, p.min_replicas, p.max_replicas,
                                    held_target(p.target_concurrency, p.target_pinned, p.sweep_concurrency,
                                                     p.recorded_target)) for p in plans)
    store, decisions = ScalingStore(engine), []
    for plan in plans:
        for axis in AXES:
            d = store.latest(plan.endpoint, axis)
            if d is not None:
                decisions.append(DecisionState(d.endpoint, d.revision_id, d.axis, d.rule, d.at.timestamp(),
                                               d.replicas, d.target))
    return Snapshot(revisions, tuple(replicas), endpoints, tuple(decisions))


class StateCollector:
    """Reads a fresh snapshot at every scrape; a database that does not answer fails the scrape
    (Prometheus then records ``up == 0`` for this target), it never serves stale numbers."""

    def __init__(self, read: Callable[[], Snapshot]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        yield from families(self._read())
