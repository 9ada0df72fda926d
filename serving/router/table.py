"""The routing table: a snapshot of endpoints, their ready replicas and the live tokens.

Built by discovery from the control-plane database (:func:`load_table`) and swapped in
whole, so a request always sees one consistent snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from controlplane.cost_profiles import CostProfileStore
from controlplane.schema import EndpointRow, ReplicaRow, RevisionRow, TrafficRow
from controlplane.tokens import Grant, TokenStore
from serving.router.cost import RouteCost


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


@dataclass(frozen=True)
class RoutingTable:
    endpoints: dict[str, EndpointRoute] = field(default_factory=dict)
    grants: dict[str, Grant] = field(default_factory=dict)  # {sha256(token): Grant}


def build_table(endpoint_names: list[str], traffic: dict[str, str], revisions: dict[str, str],
                ready: dict[str, list[str]], any_replicas: set[str], grants: dict[str, Grant],
                costs: dict[str, RouteCost] | None = None, contexts: dict[str, int] | None = None,
                cold_starts: dict[str, float] | None = None) -> RoutingTable:
    """Pure assembly of the snapshot from what the database holds.

    ``revisions`` maps revision id → runtime; ``ready`` revision id → ready replica URLs;
    ``any_replicas`` the revisions with at least one replica in any state; ``costs``
    revision id → its cost model on this router's hardware; ``contexts`` revision id → the
    context length of the model it serves; ``cold_starts`` revision id → its measured cold start.
    """
    costs, contexts, cold_starts = costs or {}, contexts or {}, cold_starts or {}
    routes = {}
    for name in endpoint_names:
        revision_id = traffic.get(name)
        urls = tuple(sorted(ready.get(revision_id, []))) if revision_id else ()
        routes[name] = EndpointRoute(name=name, runtime=revisions.get(revision_id), revision_id=revision_id,
                                     replicas=urls, starting=bool(revision_id) and not urls and revision_id in any_replicas,
                                     cost=costs.get(revision_id), context_tokens=contexts.get(revision_id),
                                     cold_start_s=cold_starts.get(revision_id))
    return RoutingTable(endpoints=routes, grants=grants)


def load_table(engine: Engine, hardware_profile: str | None = None) -> RoutingTable:
    """The snapshot, with each serving revision's cost model measured on ``hardware_profile``."""
    with Session(engine) as session:
        names = list(session.scalars(select(EndpointRow.name)))
        traffic = {row.endpoint: row.revision_id for row in session.scalars(select(TrafficRow))}
        revision_rows = {row.id: row for row in session.scalars(select(RevisionRow))}
        revisions = {rid: row.runtime for rid, row in revision_rows.items()}
        contexts = {rid: int(row.details["context_tokens"]) for rid, row in revision_rows.items()
                    if isinstance(row.details, dict) and isinstance(row.details.get("context_tokens"), int)}
        cold_starts = {rid: float(row.details["cold_start_s"]) for rid, row in revision_rows.items()
                       if isinstance(row.details, dict) and isinstance(row.details.get("cold_start_s"), (int, float))}
        ready: dict[str, list[str]] = {}
        any_replicas: set[str] = set()
        for row in session.scalars(select(ReplicaRow).where(ReplicaRow.state != "stopped")):
            any_replicas.add(row.revision_id)
            if row.state == "ready":
                ready.setdefault(row.revision_id, []).append(f"http://{row.host}:{row.port}")
    costs: dict[str, RouteCost] = {}
    if hardware_profile is not None:
        profiles = CostProfileStore(engine).for_hardware(hardware_profile)
        for revision_id in set(traffic.values()):
            row = revision_rows.get(revision_id)
            profile = profiles.get(row.partition_key) if row is not None else None
            cost = RouteCost.from_profile(profile.model) if profile is not None else None
            if cost is not None:
                costs[revision_id] = cost
    return build_table(names, traffic, revisions, ready, any_replicas, TokenStore(engine).grants(), costs, contexts,
                       cold_starts)
