"""The routing table: a snapshot of endpoints, their ready replicas and the live tokens.

Built by discovery from the control-plane database (:func:`load_table`) and swapped in
whole, so a request always sees one consistent snapshot.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from cluster.local.backend import replica_from_row
from cluster.protocol import Replica
from controlplane.cost_profiles import CostProfileStore
from controlplane.schema import EndpointRow, ReplicaRow, RevisionRow, TrafficRow
from controlplane.tokens import Grant, TokenStore
from controlplane.specs import EndpointSpec
from serving.router.cost import RouteCost
from serving.router.policy import DEFAULT_POLICY, RoutePolicy, from_spec
from serving.router.traffic import Split

log = logging.getLogger("modelplane.router")


@dataclass(frozen=True)
class EndpointRoute:
    name: str
    runtime: str | None  # "vllm" | "pyfunc"; None while no revision takes traffic
    revision_id: str | None
    replicas: tuple[str, ...]  # base URLs of ready replicas of the serving revision
    starting: bool = False  # a revision exists but no replica is ready yet
    cost: RouteCost | None = None  # the serving revision's cost model on this hardware, if measured
    context_tokens: int | None = None  # LLMs: the serving model's context length (bounds max_tokens)
    cold_start_s: float | None = None  # the serving revision's measured time to ready (how long a request is held)
    policy: RoutePolicy = DEFAULT_POLICY  # balancing, stickiness, limits, log sampling (from the spec)
    canary: Split | None = None  # a revision taking a share of the requests
    shadow: Split | None = None  # a revision receiving copies of a share of them


@dataclass(frozen=True)
class RoutingTable:
    endpoints: dict[str, EndpointRoute] = field(default_factory=dict)
    grants: dict[str, Grant] = field(default_factory=dict)  # {sha256(token): Grant}


def build_table(endpoint_names: list[str], traffic: dict[str, str], revisions: dict[str, str],
                ready: dict[str, list[str]], any_replicas: set[str], grants: dict[str, Grant],
                costs: dict[str, RouteCost] | None = None, contexts: dict[str, int] | None = None,
                cold_starts: dict[str, float] | None = None, policies: dict[str, RoutePolicy] | None = None,
                splits: dict[str, tuple[str | None, float | None, str | None, float | None]] | None = None
                ) -> RoutingTable:
    """Pure assembly of the snapshot from what the database holds.

    ``revisions`` maps revision id → runtime; ``ready`` revision id → ready replica URLs;
    ``any_replicas`` the revisions with at least one replica in any state; ``costs``
    revision id → its cost model on this router's hardware; ``contexts`` revision id → the
    context length of the model it serves; ``cold_starts`` revision id → its measured cold start;
    ``policies`` endpoint → its routing policy; ``splits`` endpoint → (canary revision, its
    percent, shadow revision, its percent) as the ``traffic`` row holds them.
    """
    costs, contexts, cold_starts = costs or {}, contexts or {}, cold_starts or {}
    policies, splits = policies or {}, splits or {}

    def split(revision_id: str | None, percent: float | None) -> Split | None:
        if not revision_id or not percent:
            return None
        return Split(revision_id, tuple(sorted(ready.get(revision_id, []))), float(percent), costs.get(revision_id))

    routes = {}
    for name in endpoint_names:
        revision_id = traffic.get(name)
        urls = tuple(sorted(ready.get(revision_id, []))) if revision_id else ()
        canary_id, canary_percent, shadow_id, shadow_percent = splits.get(name, (None, None, None, None))
        routes[name] = EndpointRoute(name=name, runtime=revisions.get(revision_id), revision_id=revision_id,
                                     replicas=urls, starting=bool(revision_id) and not urls and revision_id in any_replicas,
                                     cost=costs.get(revision_id), context_tokens=contexts.get(revision_id),
                                     cold_start_s=cold_starts.get(revision_id),
                                     policy=policies.get(name, DEFAULT_POLICY),
                                     canary=split(canary_id, canary_percent) if revision_id else None,
                                     shadow=split(shadow_id, shadow_percent) if revision_id else None)
    return RoutingTable(endpoints=routes, grants=grants)


def policy_of(name: str, spec: dict) -> RoutePolicy:
    """The routing policy of a stored spec; the defaults (and a log line) for one that no longer parses.

    Parsed once per distinct spec text: the table is re-read twice a second."""
    return _policy(name, json.dumps(spec, sort_keys=True))


@functools.lru_cache(maxsize=1024)
def _policy(name: str, spec_json: str) -> RoutePolicy:
    try:
        return from_spec(EndpointSpec.model_validate_json(spec_json))
    except ValueError as exc:
        log.warning("endpoint %s: stored spec does not parse (%s); routing it with the defaults", name, exc)
        return DEFAULT_POLICY


def load_table(engine: Engine, hardware_profile: str | None = None,
               replicas: Callable[[], list[Replica]] | None = None) -> RoutingTable:
    """The snapshot, with each serving revision's cost model measured on ``hardware_profile``.

    ``replicas``: the backend's own discovery (Kubernetes: EndpointSlices); None: the replicas
    table the local supervisor writes."""
    with Session(engine) as session:
        endpoint_rows = list(session.scalars(select(EndpointRow)))
        names = [row.name for row in endpoint_rows]
        policies = {row.name: policy_of(row.name, row.spec) for row in endpoint_rows}
        traffic_rows = list(session.scalars(select(TrafficRow)))
        traffic = {row.endpoint: row.revision_id for row in traffic_rows}
        splits = {row.endpoint: (row.canary_revision_id, row.canary_percent, row.shadow_revision_id, row.shadow_percent)
                  for row in traffic_rows}
        revision_rows = {row.id: row for row in session.scalars(select(RevisionRow))}
        revisions = {rid: row.runtime for rid, row in revision_rows.items()}
        contexts = {rid: int(row.details["context_tokens"]) for rid, row in revision_rows.items()
                    if isinstance(row.details, dict) and isinstance(row.details.get("context_tokens"), int)}
        cold_starts = {rid: float(row.details["cold_start_s"]) for rid, row in revision_rows.items()
                       if isinstance(row.details, dict) and isinstance(row.details.get("cold_start_s"), (int, float))}
        ready: dict[str, list[str]] = {}
        any_replicas: set[str] = set()
        if replicas is None:
            seen = [replica_from_row(row) for row in
                    session.scalars(select(ReplicaRow).where(ReplicaRow.state != "stopped"))]
        else:
            seen = [replica for replica in replicas() if replica.state != "stopped"]
        for replica in seen:
            any_replicas.add(replica.revision_id)
            if replica.ready:
                ready.setdefault(replica.revision_id, []).append(replica.url)
    costs: dict[str, RouteCost] = {}
    if hardware_profile is not None:
        profiles = CostProfileStore(engine).for_hardware(hardware_profile)
        for revision_id in set(traffic.values()) | {rid for split in splits.values() for rid in split[::2] if rid}:
            row = revision_rows.get(revision_id)
            profile = profiles.get(row.partition_key) if row is not None else None
            cost = RouteCost.from_profile(profile.model) if profile is not None else None
            if cost is not None:
                costs[revision_id] = cost
    return build_table(names, traffic, revisions, ready, any_replicas, TokenStore(engine).grants(), costs, contexts,
                       cold_starts, policies, splits)
