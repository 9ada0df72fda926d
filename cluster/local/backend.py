"""``LocalCluster``: the Cluster Protocol over the control-plane database.

Desired state goes into the ``revisions`` table (model files, runtime, replica count, and
the replicas a scale-down named to stop first, ``retiring``); the
supervisor process (``cluster.local.supervisor``) reconciles it into processes and writes
what it sees into the ``replicas`` table, which is also the router's discovery feed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from sqlalchemy import Engine, delete, select
from sqlalchemy.orm import Session

from cluster.hardware import local_gpu_count
from cluster.protocol import Replica, RevisionSpec, poll_changes
from controlplane.schema import ReplicaRow, RevisionRow
from controlplane.store import Clock, utc_now

#: Revision states in which the supervisor keeps replicas running.
ACTIVE_STATES = ("pending", "ready", "serving", "draining")


def replica_from_row(row: ReplicaRow) -> Replica:
    return Replica(row.id, row.revision_id, f"http://{row.host}:{row.port}", row.state == "ready", row.state,
                   row.restarts, row.last_error)


class LocalCluster:
    def __init__(self, engine: Engine, now: Clock = utc_now) -> None:
        self._engine = engine
        self._now = now

    def apply(self, spec: RevisionSpec) -> None:
        gpus = int(spec.runtime_config.get("gpus", 0) or 0)
        if gpus > local_gpu_count():
            raise ValueError(f"{spec.revision_id}: replica.gpus is {gpus} but this machine has {local_gpu_count()} "
                             "GPU(s); lower replica.gpus or serve it on the Kubernetes backend")
        now = self._now()
        with Session(self._engine) as session, session.begin():
            row = session.get(RevisionRow, spec.revision_id)
            if row is None:
                row = RevisionRow(id=spec.revision_id, endpoint=spec.endpoint, partition_key="", state="pending",
                                  created_at=now)
                session.add(row)
            if row.desired_replicas != spec.replicas:
                row.retiring = None  # a new count names no victims: the highest indices go
            row.model_dir, row.runtime = spec.model_dir, spec.runtime
            row.runtime_config, row.desired_replicas = dict(spec.runtime_config), spec.replicas
            row.image = spec.image
            row.updated_at = now

    def scale(self, revision_id: str, replicas: int, victims: Sequence[str] = ()) -> None:
        """The count and its victims in one transaction, so the supervisor never sees one without the other."""
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        with Session(self._engine) as session, session.begin():
            row = session.get(RevisionRow, revision_id)
            if row is None:
                raise KeyError(f"no revision {revision_id!r}")
            if replicas < row.desired_replicas:
                row.retiring = list(victims)
            elif replicas > row.desired_replicas:
                row.retiring = None  # a stale list must not pick the victims of a later scale-down
            row.desired_replicas = replicas
            row.updated_at = self._now()

    def replicas(self, revision_id: str | None = None) -> list[Replica]:
        with Session(self._engine) as session:
            query = select(ReplicaRow).where(ReplicaRow.state != "stopped").order_by(ReplicaRow.id)
            if revision_id is not None:
                query = query.where(ReplicaRow.revision_id == revision_id)
            return [replica_from_row(row) for row in session.scalars(query)]

    def desired_replicas(self, revision_id: str) -> int:
        with Session(self._engine) as session:
            row = session.get(RevisionRow, revision_id)
            if row is None:
                raise KeyError(f"no revision {revision_id!r}")
            return row.desired_replicas

    def watch(self, interval_s: float = 0.5, stop: Callable[[], bool] = lambda: False) -> Iterator[list[Replica]]:
        return poll_changes(self.replicas, interval_s, stop)

    def delete(self, revision_id: str) -> None:
        """Desired replicas 0 and state retired; the supervisor stops the processes."""
        with Session(self._engine) as session, session.begin():
            row = session.get(RevisionRow, revision_id)
            if row is not None:
                row.desired_replicas = 0
                row.state = "retired"
                row.updated_at = self._now()

    def converge(self, active: Sequence[RevisionSpec]) -> list[str]:
        """Nothing to do: the revisions table is this backend's desired state, and the supervisor
        converges processes to it continuously (adopting, restarting, stopping)."""
        return []

    def forget_stopped(self) -> None:
        with Session(self._engine) as session, session.begin():
            session.execute(delete(ReplicaRow).where(ReplicaRow.state == "stopped"))
