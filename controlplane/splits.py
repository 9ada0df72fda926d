"""Canary and shadow traffic: which other revision of an endpoint takes a share of its
requests, or a copy of them (``serving.router.traffic`` applies it; routers pick a change up
at their next table refresh, with no restart).

Set through the admin API (``PUT /endpoints/{name}/traffic``) or the CLI (``modelplane
endpoints traffic``). A split needs the endpoint to serve a revision already, and names
another, live revision of the same endpoint; anything else is refused with a message
(:class:`SplitError`). A revision named by a split is routed to, so the reaper spares it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from controlplane.schema import EndpointRow, RevisionRow, TrafficRow

LIVE_STATES = ("pending", "ready", "serving")
KEEP = object()  # SplitStore.set: leave this split as it is


def forget_in(session: Session, revision_id: str) -> None:
    """In ``session``'s transaction: clear the canary and shadow columns that name ``revision_id``."""
    session.execute(update(TrafficRow).where(TrafficRow.canary_revision_id == revision_id)
                    .values(canary_revision_id=None, canary_percent=None))
    session.execute(update(TrafficRow).where(TrafficRow.shadow_revision_id == revision_id)
                    .values(shadow_revision_id=None, shadow_percent=None))


class SplitError(ValueError):
    """A split that cannot be set; ``status`` is the HTTP status the admin API answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Share:
    revision_id: str
    percent: float


@dataclass(frozen=True)
class Splits:
    endpoint: str
    serving: str
    canary: Share | None = None
    shadow: Share | None = None

    def to_json(self) -> dict:
        def share(value: Share | None) -> dict | None:
            return None if value is None else {"revision": value.revision_id, "percent": value.percent}

        return {"endpoint": self.endpoint, "serving": self.serving, "canary": share(self.canary),
                "shadow": share(self.shadow)}


def _splits(row: TrafficRow) -> Splits:
    canary = Share(row.canary_revision_id, row.canary_percent) if row.canary_revision_id else None
    shadow = Share(row.shadow_revision_id, row.shadow_percent) if row.shadow_revision_id else None
    return Splits(row.endpoint, row.revision_id, canary, shadow)


class SplitStore:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def get(self, endpoint: str) -> Splits | None:
        with Session(self._engine) as session:
            row = session.get(TrafficRow, endpoint)
            return None if row is None else _splits(row)

    def set(self, endpoint: str, canary: Share | None | object = KEEP, shadow: Share | None | object = KEEP) -> Splits:
        """Set the endpoint's canary and/or shadow: a :class:`Share`, None to clear it, or
        :data:`KEEP` (the default) to leave it. One transaction, the row locked: a rollout's
        canary and a person's shadow edit never undo each other."""
        for name, share in (("canary", canary), ("shadow", shadow)):
            if isinstance(share, Share) and not (math.isfinite(share.percent) and 0 < share.percent <= 100
                                                 and (name != "canary" or share.percent < 100)):
                raise SplitError(400, f"{name} percent must be above 0 and below 100 (canary) or at most 100 "
                                      f"(shadow), got {share.percent:g}; to move all traffic, roll the version out")
        with Session(self._engine) as session, session.begin():
            row = session.execute(select(TrafficRow).where(TrafficRow.endpoint == endpoint).with_for_update()).scalar()
            if row is None:
                if session.get(EndpointRow, endpoint) is None:
                    raise SplitError(404, f"no endpoint named {endpoint!r}; `modelplane endpoints list` shows them")
                raise SplitError(409, f"endpoint {endpoint!r} serves no revision yet; a canary or shadow needs one "
                                      "serving beside it")
            for name, share in (("canary", canary), ("shadow", shadow)):
                if isinstance(share, Share):
                    self._check(session, endpoint, row, name, share)
            if canary is not KEEP:
                row.canary_revision_id, row.canary_percent = (canary.revision_id, canary.percent) if canary \
                    else (None, None)
            if shadow is not KEEP:
                row.shadow_revision_id, row.shadow_percent = (shadow.revision_id, shadow.percent) if shadow \
                    else (None, None)
            row.updated_at = datetime.now(timezone.utc)
            return _splits(row)

    @staticmethod
    def _check(session: Session, endpoint: str, row: TrafficRow, name: str, share: Share) -> None:
        revision = session.get(RevisionRow, share.revision_id)
        if revision is None or revision.endpoint != endpoint:
            raise SplitError(404, f"no revision {share.revision_id!r} of endpoint {endpoint!r}; "
                                  f"`modelplane endpoints status {endpoint}` lists them")
        if share.revision_id == row.revision_id:
            raise SplitError(400, f"{share.revision_id!r} already serves {endpoint!r}; a {name} must be another "
                                  "revision")
        if revision.state not in LIVE_STATES:
            raise SplitError(409, f"revision {share.revision_id!r} is {revision.state}; a {name} must be one of: "
                                  f"{', '.join(LIVE_STATES)}")

    def forget(self, revision_id: str) -> None:
        """Clear every split that names ``revision_id`` (it is retired, or serves now)."""
        with Session(self._engine) as session, session.begin():
            forget_in(session, revision_id)

    def routed(self) -> set[str]:
        """Every revision some endpoint routes to: serving, canary or shadow."""
        with Session(self._engine) as session:
            rows = session.execute(select(TrafficRow.revision_id, TrafficRow.canary_revision_id,
                                          TrafficRow.shadow_revision_id)).all()
        return {revision for row in rows for revision in row if revision}
