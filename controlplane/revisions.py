"""Revisions of endpoints and which one takes each endpoint's traffic.

A revision id is ``<endpoint>-v<version>-<8 hex digits>``: unique without a read-then-write
(two runs creating revisions of one endpoint at once never collide) and at most
63 + 2 + 10 + 1 + 8 = 84 characters, inside the 96 of the column, whatever the model name.

Traffic moves by compare-and-set: :meth:`RevisionStore.route` with ``expected_previous``
switches the endpoint only if it still routes to the revision the rollout saw when it
began, so two rollouts of one endpoint can never both win; the loser gets
:class:`TrafficChanged` and retires its revision.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Engine, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from cluster.protocol import RevisionSpec
from controlplane.schema import RevisionRow, TrafficRow
from controlplane.splits import forget_in
from controlplane.store import Clock, utc_now

STATES = ("pending", "ready", "serving", "draining", "retired", "failed")
UNCHECKED = object()  # route() without a compare-and-set
# A revision's details key: True for a revision started for one measurement (the cost sweep's
# benchmark replica), whose runtime environment no later replica is known to share. The local
# warm pool keeps a runtime warm for the replicas that serve, not for these (cluster.local.replica).
ONE_OFF = "one_off"


class TrafficChanged(Exception):
    """The endpoint's traffic moved since the rollout looked: ``current`` routes it now."""

    def __init__(self, endpoint: str, current: str | None) -> None:
        super().__init__(f"{endpoint}: traffic moved to {current} since this rollout began")
        self.current = current


def revision_id(endpoint: str, partition_key: str) -> str:
    """``gec`` + ``gec.v12`` → ``gec-v12-`` and 8 random hex digits."""
    version = partition_key.rpartition(".v")[2] or "0"
    return f"{endpoint}-v{version[:10]}-{secrets.token_hex(4)}"


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
    details: dict = field(default_factory=dict)  # checkpoint, eval gate verdict, hardware, owning run
    updated_at: datetime | None = None
    image: dict | None = None  # the serving image its replicas start from (cluster.protocol.RevisionSpec.image)


def revision_spec(revision: Revision, replicas: int | None = None) -> RevisionSpec:
    """What a backend runs for a revision: its own count unless ``replicas`` says otherwise."""
    # its own measured start once it has one, else the cost sweep's replica's (the same model, hardware)
    expected = revision.details.get("cold_start_s") or revision.details.get("expected_start_s")
    return RevisionSpec(revision.id, revision.endpoint, revision.model_dir, revision.runtime,
                        revision.desired_replicas if replicas is None else replicas, revision.runtime_config,
                        revision.image, float(expected) if isinstance(expected, (int, float)) else None)


def _revision(row: RevisionRow) -> Revision:
    return Revision(row.id, row.endpoint, row.partition_key, row.model_dir, row.runtime, dict(row.runtime_config),
                    row.desired_replicas, row.state, row.created_at, dict(row.details or {}), row.updated_at,
                    row.image)


class RevisionStore:
    def __init__(self, engine: Engine, now: Clock = utc_now) -> None:
        self._engine = engine
        self._now = now

    def create(self, endpoint: str, partition_key: str, model_dir: str, runtime: str, runtime_config: dict,
               replicas: int, details: dict | None = None, image: dict | None = None) -> Revision:
        """A new pending revision ``<endpoint>-v<version>-<random>``."""
        now = self._now()
        with Session(self._engine) as session, session.begin():
            row = RevisionRow(id=revision_id(endpoint, partition_key), endpoint=endpoint, partition_key=partition_key,
                              model_dir=model_dir, runtime=runtime, runtime_config=runtime_config,
                              details=details or {}, image=image, desired_replicas=replicas, state="pending", created_at=now,
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

    def add_details(self, revision_id: str, **details) -> None:
        """Merge ``details`` into the revision's details (e.g. the run that owns it)."""
        with Session(self._engine) as session, session.begin():
            row = session.get(RevisionRow, revision_id)
            if row is None:
                raise KeyError(f"no revision {revision_id!r}")
            row.details = {**(row.details or {}), **details}
            row.updated_at = self._now()

    def set_state(self, revision_id: str, state: str) -> None:
        if state not in STATES:
            raise ValueError(f"unknown revision state {state!r}; one of {', '.join(STATES)}")
        with Session(self._engine) as session, session.begin():
            row = session.get(RevisionRow, revision_id)
            if row is None:
                raise KeyError(f"no revision {revision_id!r}")
            row.state = state
            row.updated_at = self._now()
            if state in ("draining", "retired", "failed"):  # no canary or shadow goes on to it
                forget_in(session, revision_id)

    def route(self, endpoint: str, revision_id: str, expected_previous=UNCHECKED) -> str | None:
        """Send all of ``endpoint``'s traffic to ``revision_id``; returns the revision it replaced.

        With ``expected_previous`` (a revision id, or None for "no traffic yet") the switch is
        a compare-and-set: one ``UPDATE … WHERE revision_id = expected`` (or an ``INSERT`` that
        the primary key refuses a second time), which raises :class:`TrafficChanged` when the
        endpoint routes elsewhere by now.
        """
        now = self._now()
        if expected_previous is UNCHECKED:
            with Session(self._engine) as session, session.begin():
                row = session.get(TrafficRow, endpoint)
                previous = None if row is None else row.revision_id
                if row is None:
                    session.add(TrafficRow(endpoint=endpoint, revision_id=revision_id, updated_at=now))
                else:
                    row.revision_id, row.updated_at = revision_id, now
                forget_in(session, revision_id)  # a canary or shadow that now serves is one no longer
                return previous
        try:
            with Session(self._engine) as session, session.begin():
                if expected_previous is None:
                    session.add(TrafficRow(endpoint=endpoint, revision_id=revision_id, updated_at=now))
                    session.flush()
                    return None
                moved = session.execute(update(TrafficRow).where(TrafficRow.endpoint == endpoint,
                                                                 TrafficRow.revision_id == expected_previous)
                                        .values(revision_id=revision_id, updated_at=now)).rowcount
                if moved == 1:
                    forget_in(session, revision_id)
                    return expected_previous
        except IntegrityError:
            pass
        raise TrafficChanged(endpoint, self.traffic().get(endpoint))

    def traffic(self) -> dict[str, str]:
        """{endpoint: revision id taking its traffic}."""
        with Session(self._engine) as session:
            return {row.endpoint: row.revision_id for row in session.scalars(select(TrafficRow))}

    def unroute(self, endpoint: str) -> None:
        with Session(self._engine) as session, session.begin():
            row = session.get(TrafficRow, endpoint)
            if row is not None:
                session.delete(row)
