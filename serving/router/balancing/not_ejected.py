"""Filter: drop the replicas the outlier detector ejected.

``kept = [url for url in candidates if url not in snapshot.ejected]``; when nothing is
ejected the candidates are returned as they are (no copy). If every candidate is ejected,
the :class:`~serving.router.balancing.base.Balancer` keeps them all rather than fail.

>>> from serving.router.balancing.base import Snapshot
>>> not_ejected(["a", "b", "c"], Snapshot(units={}, requests={}, ejected=frozenset({"b"})))
['a', 'c']
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.router.balancing.base import Snapshot


def not_ejected(candidates: Sequence[str], snapshot: Snapshot) -> Sequence[str]:
    ejected = snapshot.ejected
    if not ejected:
        return candidates
    return [url for url in candidates if url not in ejected]
