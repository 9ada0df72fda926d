"""An in-memory Cluster: replicas appear at once and become ready when a test says so.

Which ids start and stop is :func:`cluster.replica_plan.plan`, as in the local supervisor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

from cluster.protocol import Replica, RevisionSpec, poll_changes
from cluster.replica_plan import plan


class InMemoryCluster:
    def __init__(self, ready_on_start: bool = True) -> None:
        self.revisions: dict[str, RevisionSpec] = {}
        self._replicas: dict[str, Replica] = {}
        self._ready_on_start = ready_on_start
        self._next_port = 20000

    def apply(self, spec: RevisionSpec) -> None:
        self.revisions[spec.revision_id] = spec
        self._reconcile(spec.revision_id)

    def scale(self, revision_id: str, replicas: int, victims: Sequence[str] = ()) -> None:
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        if revision_id not in self.revisions:
            raise KeyError(f"no revision {revision_id!r}")
        spec = self.revisions[revision_id]
        self.revisions[revision_id] = dataclasses.replace(spec, replicas=replicas)
        self._reconcile(revision_id, victims if replicas < spec.replicas else ())

    def replicas(self, revision_id: str | None = None) -> list[Replica]:
        return sorted((r for r in self._replicas.values() if revision_id in (None, r.revision_id)),
                      key=lambda r: r.replica_id)

    def desired_replicas(self, revision_id: str) -> int:
        if revision_id not in self.revisions:
            raise KeyError(f"no revision {revision_id!r}")
        return self.revisions[revision_id].replicas

    def watch(self, interval_s: float = 0.5, stop: Callable[[], bool] = lambda: False) -> Iterator[list[Replica]]:
        return poll_changes(self.replicas, interval_s, stop)

    def delete(self, revision_id: str) -> None:
        self.revisions.pop(revision_id, None)
        for replica_id in [r.replica_id for r in self.replicas(revision_id)]:
            del self._replicas[replica_id]

    def converge(self, active: Sequence[RevisionSpec]) -> list[str]:
        wanted = {spec.revision_id: spec for spec in active}
        changed = []
        for revision_id in sorted(set(self.revisions) - set(wanted)):
            self.delete(revision_id)
            changed.append(f"deleted {revision_id}")
        for revision_id, spec in sorted(wanted.items()):
            if revision_id not in self.revisions:
                self.apply(spec)
                changed.append(f"finished {revision_id}")
        return changed

    def set_ready(self, replica_id: str, ready: bool = True) -> None:
        """Test hook: what the supervisor's readiness probe decides."""
        replica = self._replicas[replica_id]
        self._replicas[replica_id] = Replica(replica.replica_id, replica.revision_id, replica.url, ready,
                                             "ready" if ready else "unhealthy", replica.restarts)

    def _reconcile(self, revision_id: str, retiring: Sequence[str] = ()) -> None:
        running = {r.replica_id for r in self.replicas(revision_id)}
        to_start, to_stop = plan({revision_id: self.revisions[revision_id].replicas}, running,
                                 {revision_id: retiring})
        for replica_id in to_stop:
            del self._replicas[replica_id]
        for replica_id in to_start:
            self._next_port += 1
            ready = self._ready_on_start
            self._replicas[replica_id] = Replica(replica_id, revision_id, f"http://127.0.0.1:{self._next_port}",
                                                 ready, "ready" if ready else "starting")
