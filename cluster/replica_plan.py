"""Which replica ids to start and stop so that every revision runs its desired count.

A revision's replicas are named ``<revision>-<index>``. When a revision has more running
replicas than it wants, the ones named as retiring (``Cluster.scale``'s victims) stop first,
in the order named and only as many as needed to come down to the count; if it is still
above the count, the highest indices stop. When it has fewer, the lowest free indices start,
so an index freed by a scale-down is reused and no two running replicas share an id.
Replicas of a revision no longer wanted at all stop. Both the local supervisor and the
in-memory fake cluster decide with :func:`plan`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def replica_index(replica_id: str) -> tuple[str, int]:
    """``("gec-v2-1", 3)`` for ``"gec-v2-1-3"``: the revision id may hold dashes, the index does not."""
    revision, _, index = replica_id.rpartition("-")
    return revision, int(index)


def plan(desired: Mapping[str, int], running: set[str],
         retiring: Mapping[str, Sequence[str]] | None = None) -> tuple[list[str], list[str]]:
    """Replica ids to start and to stop, each sorted, so that revision ``r`` runs ``desired[r]`` replicas.

    ``retiring[r]``: ids of ``r`` to stop first when ``r`` runs more than it wants; ids that
    are not running are ignored, and none of them stops while ``r`` is at or below its count.

    >>> plan({"gec-v2-1": 2, "gec-v1-1": 0}, {"gec-v1-1-0", "gec-v2-1-0"})
    (['gec-v2-1-1'], ['gec-v1-1-0'])

    Three running, one wanted, ``r-0`` retiring: ``r-0`` goes first, then the highest index
    left (``r-2``); a later scale-up to 3 reuses the lowest free indices, 0 and 2:

    >>> plan({"r": 1}, {"r-0", "r-1", "r-2"}, {"r": ["r-0"]})
    ([], ['r-0', 'r-2'])
    >>> plan({"r": 3}, {"r-1"}, {"r": ["r-1"]})
    (['r-0', 'r-2'], [])
    """
    retiring = retiring or {}
    by_revision: dict[str, set[str]] = {}
    for replica_id in running:
        by_revision.setdefault(replica_index(replica_id)[0], set()).add(replica_id)
    to_start: list[str] = []
    to_stop: list[str] = []
    for revision, replica_ids in by_revision.items():
        if revision not in desired:
            to_stop.extend(replica_ids)
    for revision, count in desired.items():
        mine = by_revision.get(revision, set())
        excess = len(mine) - count
        stopping: list[str] = []
        for replica_id in retiring.get(revision, ()):
            if excess > len(stopping) and replica_id in mine and replica_id not in stopping:
                stopping.append(replica_id)
        highest_first = sorted(mine - set(stopping), key=lambda rid: replica_index(rid)[1], reverse=True)
        stopping.extend(highest_first[:max(0, excess - len(stopping))])
        to_stop.extend(stopping)
        taken = {replica_index(rid)[1] for rid in mine}
        free = (index for index in range(len(mine) + count) if index not in taken)
        to_start.extend(f"{revision}-{next(free)}" for _ in range(max(0, -excess)))
    return sorted(to_start), sorted(to_stop)
