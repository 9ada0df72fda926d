"""Scorer: fewer requests in flight is better (for endpoints without a cost model).

``score(url) = 1 / (1 + requests[url])``, with ``requests`` the replica's in-flight request
count (missing = 0). Every request weighs the same, however long its prompt.

Worked example: 0 requests → 1.0; 1 → 0.5; 4 → 0.2.

>>> from serving.router.balancing.base import Snapshot
>>> snapshot = Snapshot(units={}, requests={"a": 1, "b": 4})
>>> [RequestsInFlight().score(url, snapshot) for url in ("idle", "a", "b")]
[1.0, 0.5, 0.2]
"""

from __future__ import annotations

from serving.router.balancing.base import Snapshot


class RequestsInFlight:
    """``1 / (1 + in-flight requests)``."""

    __slots__ = ()

    def score(self, url: str, snapshot: Snapshot) -> float:
        requests = snapshot.requests.get(url, 0)
        return 1.0 / (1.0 + requests) if requests > 0 else 1.0
