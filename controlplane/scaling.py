"""What the autoscaler decided, and which controller may decide: decisions and the leader lease.

Every decision the controller applies is a row: the endpoint and revision, the axis
(``horizontal``: replica count; ``vertical``: per-replica target), the value set, the rule
that set it, a sentence with its numbers and the inputs. ``modelplane endpoints status``
shows the newest of each axis; a restarted controller reloads the newest target from here.

One controller acts at a time: it holds the ``autoscaler`` lease, a row it renews every
loop; another controller takes the lease only once it has expired (compare-and-set on the
row, so two cannot both win).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import Engine, delete, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.schema import DemandMinuteRow, LeaseRow, ScalingDecisionRow
from controlplane.store import Clock, utc_now

AXES = ("horizontal", "vertical")
AUTOSCALER_LEASE = "autoscaler"
AUTOSCALER_LEASE_TTL_S = 10.0  # renewed every second by the leader
DEMAND_KEPT_MINUTES = 8 * 24 * 60  # the predictive floor looks a day and a week back
KEEP_PER_ENDPOINT = 1000  # older decisions are pruned: the table is a recent log, not an archive


@dataclass(frozen=True)
class ScalingDecision:
    endpoint: str
    revision_id: str
    axis: str
    at: datetime
    replicas: int | None
    target: float | None
    rule: str
    reason: str
    inputs: dict


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


class ScalingStore:
    def __init__(self, engine: Engine, now: Clock = utc_now) -> None:
        self._engine = engine
        self._now = now

    def record(self, endpoint: str, revision_id: str, axis: str, *, rule: str, reason: str, inputs: dict,
               replicas: int | None = None, target: float | None = None) -> ScalingDecision:
        if axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
        at = self._now()
        with Session(self._engine) as session, session.begin():
            session.execute(insert(ScalingDecisionRow).values(
                endpoint=endpoint, revision_id=revision_id, axis=axis, at=at, replicas=replicas, target=target,
                rule=rule, reason=reason, inputs=inputs))
            ids = session.scalars(select(ScalingDecisionRow.id).where(ScalingDecisionRow.endpoint == endpoint)
                                  .order_by(ScalingDecisionRow.id.desc()).offset(KEEP_PER_ENDPOINT)).all()
            if ids:
                session.execute(delete(ScalingDecisionRow).where(ScalingDecisionRow.id.in_(ids)))
        return ScalingDecision(endpoint, revision_id, axis, at, replicas, target, rule, reason, inputs)

    def latest(self, endpoint: str, axis: str, revision_id: str | None = None) -> ScalingDecision | None:
        """The newest decision on ``axis`` for the endpoint (and revision, when given)."""
        query = (select(ScalingDecisionRow).where(ScalingDecisionRow.endpoint == endpoint,
                                                  ScalingDecisionRow.axis == axis)
                 .order_by(ScalingDecisionRow.id.desc()).limit(1))
        if revision_id is not None:
            query = query.where(ScalingDecisionRow.revision_id == revision_id)
        with Session(self._engine) as session:
            row = session.scalars(query).first()
        return None if row is None else ScalingDecision(row.endpoint, row.revision_id, row.axis, _aware(row.at),
                                                         row.replicas, row.target, row.rule, row.reason, row.inputs)

    def recent(self, endpoint: str, limit: int = 20) -> list[ScalingDecision]:
        with Session(self._engine) as session:
            rows = session.scalars(select(ScalingDecisionRow).where(ScalingDecisionRow.endpoint == endpoint)
                                   .order_by(ScalingDecisionRow.id.desc()).limit(limit)).all()
        return [ScalingDecision(r.endpoint, r.revision_id, r.axis, _aware(r.at), r.replicas, r.target, r.rule,
                                r.reason, r.inputs) for r in rows]

    def save_demand(self, endpoint: str, minute: int, peak_in_flight: float) -> None:
        """Store (or raise) the endpoint's peak in flight of ``minute``; minutes older than 8 days are pruned."""
        with Session(self._engine) as session, session.begin():
            row = session.get(DemandMinuteRow, (endpoint, minute))
            if row is None:
                session.add(DemandMinuteRow(endpoint=endpoint, minute=minute, peak_in_flight=peak_in_flight))
            else:
                row.peak_in_flight = max(row.peak_in_flight, peak_in_flight)
            session.execute(delete(DemandMinuteRow).where(DemandMinuteRow.endpoint == endpoint,
                                                          DemandMinuteRow.minute < minute - DEMAND_KEPT_MINUTES))

    def demand(self, endpoint: str, since_minute: int) -> dict[int, float]:
        """``{minute: peak in flight}`` from ``since_minute`` on, oldest first."""
        with Session(self._engine) as session:
            rows = session.scalars(select(DemandMinuteRow).where(DemandMinuteRow.endpoint == endpoint,
                                                                 DemandMinuteRow.minute >= since_minute)
                                   .order_by(DemandMinuteRow.minute)).all()
        return {row.minute: row.peak_in_flight for row in rows}


class Lease:
    """A named lease in the database: ``acquire`` takes or renews it; only its holder acts."""

    def __init__(self, engine: Engine, name: str, holder: str, ttl_s: float, now: Clock = utc_now) -> None:
        self._engine, self.name, self.holder, self.ttl_s, self._now = engine, name, holder, ttl_s, now

    def acquire(self) -> bool:
        """True when this holder has the lease for the next ``ttl_s`` (renewed, or taken over an expired one)."""
        now = self._now()
        expires = now + timedelta(seconds=self.ttl_s)
        with Session(self._engine) as session, session.begin():
            taken = session.execute(
                update(LeaseRow).where(LeaseRow.name == self.name,
                                       (LeaseRow.holder == self.holder) | (LeaseRow.expires_at < now))
                .values(holder=self.holder, expires_at=expires)).rowcount
            if taken:
                return True
            if session.get(LeaseRow, self.name) is not None:
                return False
        try:
            with Session(self._engine) as session, session.begin():
                session.add(LeaseRow(name=self.name, holder=self.holder, expires_at=expires))
            return True
        except IntegrityError:  # another holder created it first
            return False

    def holder_now(self) -> tuple[str, datetime] | None:
        with Session(self._engine) as session:
            row = session.get(LeaseRow, self.name)
        return None if row is None else (row.holder, _aware(row.expires_at))

    def release(self) -> None:
        with Session(self._engine) as session, session.begin():
            session.execute(delete(LeaseRow).where(LeaseRow.name == self.name, LeaseRow.holder == self.holder))
