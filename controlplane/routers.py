"""Which routing table each router serves: what a drain waits on instead of a fixed grace time.

Every router re-reads its table from the database every ``refresh_interval_s`` and then
reports here when that read began (``table_read_at``); the report is also its heartbeat. A
rollout that moved an endpoint's traffic at time T drains the old revision only once every
live router serves a table read at T or later: from then on no router sends it a new
request. A router silent for ``stale_after_s`` is not waited for (it is gone, or cannot
reach the database and so cannot route anything new either).

Times are UTC from the clock of whoever writes them; on one machine that is one clock.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import Engine, delete, select
from sqlalchemy.orm import Session

from controlplane.schema import RouterRow
from controlplane.store import Clock, utc_now

STALE_AFTER_S = 10.0


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


class RouterStore:
    def __init__(self, engine: Engine, now: Clock = utc_now) -> None:
        self._engine = engine
        self._now = now

    def report(self, router_id: str, table_read_at: datetime, url: str | None = None) -> None:
        """Router ``router_id`` (answering at ``url``) now serves the table it began reading at ``table_read_at``."""
        with Session(self._engine) as session, session.begin():
            row = session.get(RouterRow, router_id)
            if row is None:
                row = RouterRow(id=router_id)
                session.add(row)
            row.table_read_at, row.heartbeat_at = table_read_at, self._now()
            if url is not None:
                row.url = url

    def live_urls(self, stale_after_s: float = STALE_AFTER_S) -> dict[str, str]:
        """``{router id: url}`` of the routers that reported within ``stale_after_s`` and said where they answer."""
        live_after = self._now() - timedelta(seconds=stale_after_s)
        with Session(self._engine) as session:
            rows = session.scalars(select(RouterRow)).all()
        return {r.id: r.url for r in rows if r.url and _aware(r.heartbeat_at) >= live_after}

    def newest_heartbeat(self) -> datetime | None:
        """When the most recent router report arrived (None: no router ever reported)."""
        with Session(self._engine) as session:
            rows = session.scalars(select(RouterRow)).all()
        return max((_aware(r.heartbeat_at) for r in rows), default=None)

    def forget(self, router_id: str) -> None:
        """A router shutting down leaves the list (no drain waits for it)."""
        with Session(self._engine) as session, session.begin():
            session.execute(delete(RouterRow).where(RouterRow.id == router_id))

    def lagging(self, since: datetime, stale_after_s: float = STALE_AFTER_S) -> list[str]:
        """Live routers whose table was read before ``since``: they may still route to what it replaced."""
        live_after = self._now() - timedelta(seconds=stale_after_s)
        with Session(self._engine) as session:
            rows = session.scalars(select(RouterRow)).all()
        return sorted(r.id for r in rows if _aware(r.heartbeat_at) >= live_after and _aware(r.table_read_at) < since)
