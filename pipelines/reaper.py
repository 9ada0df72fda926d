"""Which revisions nothing needs any more (pure): no endpoint routes to them and no live run owns them.

A rollout retires the revision it replaces, and one that fails or is superseded retires its
own. What is left over comes from runs that died half-way (a terminated run, a crashed run
worker, a machine restart): a revision that started replicas and was never routed to, or an
old one that was never drained. Each is retired so that no replica keeps running for
nothing. A revision is spared while the run that created it is queued or running, and for
``grace_s`` after its last change (its run may not be visible yet).

>>> from datetime import datetime, timezone
>>> t = datetime(2027, 1, 1, tzinfo=timezone.utc)
>>> rows = [Owned("gec-v2-aa", "ready", "run-1", t), Owned("gec-v1-bb", "serving", "run-0", t)]
>>> orphans(rows, routed={"gec-v1-bb"}, live_runs=set(), now=t.replace(minute=5))
['gec-v2-aa']
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

ACTIVE = ("pending", "ready", "serving", "draining")
DEFAULT_GRACE_S = 120.0


@dataclass(frozen=True)
class Owned:
    revision_id: str
    state: str
    run_id: str | None  # the Dagster run that created it (None: unknown)
    updated_at: datetime


def orphans(revisions: Iterable[Owned], routed: set[str], live_runs: set[str], now: datetime,
            grace_s: float = DEFAULT_GRACE_S) -> list[str]:
    """Revisions to retire: active, routed to by no endpoint, owned by no live run, quiet for ``grace_s``."""
    return sorted(r.revision_id for r in revisions
                  if r.state in ACTIVE and r.revision_id not in routed and (r.run_id is None or r.run_id not in live_runs)
                  and (now - r.updated_at).total_seconds() >= grace_s)
