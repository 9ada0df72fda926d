"""Revisions of endpoints and which one takes each endpoint's traffic."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from controlplane.schema import RevisionRow, TrafficRow
from controlplane.store import Clock, utc_now

STATES = ("pending", "ready", "serving", "draining", "retired", "failed")


@dataclass(frozen=True)
class Revision:
    id: str
    endpoint: str
    partition_key: str
    model_dir: str
    runtime: str
    runtime_config: dict
    desired_replicas: int
    state: str
    created_at: datetime
    details: dict = field(default_factory=dict)  # checkpoint, eval gate verdict, hardware (assets.served_endpoint)


def _revision(row: RevisionRow) -> Revision:
    return Revision(row.id, row.endpoint, row.partition_key, row.model_dir, row.runtime, dict(row.runtime_config),
                    row.desired_replicas, row.state, row.created_at, dict(row.details or {}))


class RevisionStore:
    def __init__(self, engine: Engine, now: Clock = utc_now) -> None:
        self._engine = engine
        self._now = now

    def create(self, endpoint: str, partition_key: str, model_dir: str, runtime: str, runtime_config: dict,
               replicas: int, details: dict | None = None) -> Revision:
        """A new pending revision ``<endpoint>-<partition>-<n>`` (n counts redeploys of one version)."""
        now = self._now()
        with Session(self._engine) as session, session.begin():
            taken = session.scalars(select(RevisionRow.id).where(RevisionRow.endpoint == endpoint,
                                                                RevisionRow.partition_key == partition_key)).all()
            row = RevisionRow(id=f"{endpoint}-{partition_key.replace('.', '-')}-{len(taken) + 1}", endpoint=endpoint, partition_key=partition_key,
                              model_dir=model_dir, runtime=runtime, runtime_config=runtime_config,
                              details=details or {}, desired_replicas=replicas, state="pending", created_at=now,
                              updated_at=now)
            session.add(row)
            session.flush()
            return _revision(row)

    def get(self, revision_id: str) -> Revision | None:
        with Session(self._engine) as session:
            row = session.get(RevisionRow, revision_id)
            return None if row is None else _revision(row)

    def list(self, endpoint: str | None = None, states: tuple[str, ...] = STATES) -> list[Revision]:
        with Session(self._engine) as session:
            query = select(RevisionRow).where(RevisionRow.state.in_(states)).order_by(RevisionRow.created_at)
            if endpoint is not None:
                query = query.where(RevisionRow.endpoint == endpoint)
            return [_revision(row) for row in session.scalars(query)]

    def set_state(self, revision_id: str, state: str) -> None:
        if state not in STATES:
            raise ValueError(f"unknown revision state {state!r}; one of {', '.join(STATES)}")
        with Session(self._engine) as session, session.begin():
            row = session.get(RevisionRow, revision_id)
            if row is None:
                raise KeyError(f"no revision {revision_id!r}")
            row.state = state
            row.updated_at = self._now()

    def route(self, endpoint: str, revision_id: str) -> str | None:
        """Send all of ``endpoint``'s traffic to ``revision_id``; returns the revision it replaced."""
        with Session(self._engine) as session, session.begin():
            row = session.get(TrafficRow, endpoint)
            previous = None if row is None else row.revision_id
            if row is None:
                session.add(TrafficRow(endpoint=endpoint, revision_id=revision_id, updated_at=self._now()))
            else:
                row.revision_id = revision_id
                row.updated_at = self._now()
            return previous

    def traffic(self) -> dict[str, str]:
        """{endpoint: revision id taking its traffic}."""
        with Session(self._engine) as session:
            return {row.endpoint: row.revision_id for row in session.scalars(select(TrafficRow))}

    def unroute(self, endpoint: str) -> None:
        with Session(self._engine) as session, session.begin():
            row = session.get(TrafficRow, endpoint)
            if row is not None:
                session.delete(row)
