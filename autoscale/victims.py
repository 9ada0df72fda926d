"""Which replicas go when the endpoint scales down.

The replicas with the least in-flight work go first, so the fewest requests wait on a drain;
among equally idle ones the highest id goes first (compared as strings; on the local backend,
whose ids are ``<revision>-<index>`` with freed indices reused, usually the newest replica, so
the replicas whose caches are warmest stay).
The choice is deterministic: the same snapshot always names the same victims.

    >>> pick_victims({"r-001": 3.0, "r-002": 0.0, "r-003": 0.0, "r-004": 1.5}, 3)
    ['r-003', 'r-002', 'r-004']
"""

from __future__ import annotations

from collections.abc import Mapping


def pick_victims(in_flight_by_replica: Mapping[str, float], count: int) -> list[str]:
    """The ``count`` replicas to remove: least in flight first, ties by replica id descending.

    ``count`` at or below 0 names none; above the number of replicas names them all.
    """
    if count <= 0:
        return []
    newest_first = sorted(in_flight_by_replica.items(), key=lambda item: item[0], reverse=True)
    least_busy_first = sorted(newest_first, key=lambda item: item[1])  # stable: keeps newest first among ties
    return [replica for replica, _ in least_busy_first[:count]]
