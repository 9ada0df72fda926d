"""Scorer: fewer model units in flight is better.

``score(url) = 1 / (1 + units[url])``, with ``units`` the replica's in-flight model units
(a request's estimated replica time, ``serving.router.cost``; missing = 0, negative float
drift clamped to 0). The score is 1 for an idle replica and falls toward 0 as work piles up,
so it stays in [0, 1] whatever the scale of the units.

Worked example: 0 units → 1.0; 3 units → 1/4 = 0.25; 9 units → 0.1.

>>> from serving.router.balancing.base import Snapshot
>>> snapshot = Snapshot(units={"a": 3.0, "b": 9.0}, requests={})
>>> [UnitsInFlight().score(url, snapshot) for url in ("idle", "a", "b")]
[1.0, 0.25, 0.1]
"""

from __future__ import annotations

from serving.router.balancing.base import Snapshot


class UnitsInFlight:
    """``1 / (1 + in-flight model units)``."""

    __slots__ = ()

    def score(self, url: str, snapshot: Snapshot) -> float:
        units = snapshot.units.get(url, 0.0)
        return 1.0 / (1.0 + units) if units > 0 else 1.0
