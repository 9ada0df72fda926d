"""An in-memory Cluster: replicas appear at once and become ready when a test says so."""

from __future__ import annotations

from collections.abc import Iterator

from cluster.protocol import Replica, RevisionSpec, poll_changes


class InMemoryCluster:
    def __init__(self, ready_on_start: bool = True) -> None:
        self.revisions: dict[str, RevisionSpec] = {}
        self._replicas: dict[str, Replica] = {}
        self._ready_on_start = ready_on_start
        self._next_port = 20000

    def apply(self, spec: RevisionSpec) -> None:
        self.revisions[spec.revision_id] = spec
        self._reconcile(spec.revision_id)

    def scale(self, revision_id: str, replicas: int) -> None:
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        if revision_id not in self.revisions:
            raise KeyError(f"no revision {revision_id!r}")
        spec = self.revisions[revision_id]
        self.revisions[revision_id] = RevisionSpec(spec.revision_id, spec.endpoint, spec.model_dir, spec.runtime,
                                                   replicas, spec.runtime_config)
        self._reconcile(revision_id)

    def replicas(self, revision_id: str | None = None) -> list[Replica]:
        return sorted((r for r in self._replicas.values() if revision_id in (None, r.revision_id)),
                      key=lambda r: r.replica_id)

    def watch(self, interval_s: float = 0.5) -> Iterator[list[Replica]]:
        return poll_changes(self.replicas, interval_s)

    def delete(self, revision_id: str) -> None:
        self.revisions.pop(revision_id, None)
        for replica_id in [r.replica_id for r in self.replicas(revision_id)]:
            del self._replicas[replica_id]

    def set_ready(self, replica_id: str, ready: bool = True) -> None:
        """Test hook: what the supervisor's readiness probe decides."""
        replica = self._replicas[replica_id]
        self._replicas[replica_id] = Replica(replica.replica_id, replica.revision_id, replica.url, ready,
                                             "ready" if ready else "unhealthy", replica.restarts)

    def _reconcile(self, revision_id: str) -> None:
        wanted = self.revisions[revision_id].replicas
        for index in range(wanted):
            replica_id = f"{revision_id}-{index}"
            if replica_id not in self._replicas:
                self._next_port += 1
                ready = self._ready_on_start
                self._replicas[replica_id] = Replica(replica_id, revision_id, f"http://127.0.0.1:{self._next_port}",
                                                     ready, "ready" if ready else "starting")
        for replica in self.replicas(revision_id):
            if int(replica.replica_id.rsplit("-", 1)[1]) >= wanted:
                del self._replicas[replica.replica_id]
