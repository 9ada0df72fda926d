"""The local backend's process supervisor: desired revisions in the database → replica processes.

Every ``reconcile_interval_s`` it reads the revisions' desired replica counts, starts and
stops replicas to match (:func:`cluster.replica_plan.plan`: the replicas ``Cluster.scale``
named as victims stop first; stops run in parallel), and each replica is watched
by a thread of its own (:class:`ManagedReplica`): start the runtime's process on a free port,
wait for ``GET /health``, send the runtime's probe request (ready = model loaded and one
request answered), then watch forward progress through ``/metrics`` and restart the process,
with exponential backoff, when it exits or is found hung. What it sees goes into the
``replicas`` table, the router's discovery feed. ``python -m cluster.local.supervisor`` runs
it (``modelplane up`` does).

A supervisor that starts after another one stopped or crashed adopts the replicas that are
still healthy (:mod:`cluster.local.adoption`) instead of restarting them, so the endpoints
keep serving while ``modelplane up`` restarts it. A watcher never dies silently: an unexpected error in one life of a replica is logged and
ends that life like a crash (the process is stopped and started again), and the reconcile
loop replaces a watcher thread that is gone. A replica is marked unhealthy *before* its
process is stopped, and status writes are retried through a locked database, so a killed
replica is never left marked ready.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import psutil
from sqlalchemy import Engine, delete, select
from sqlalchemy.orm import Session

from cluster.local.adoption import AdoptedProcess, healthy, replica_process
from cluster.local.backend import ACTIVE_STATES
# also imported from here by tests, benchmarks and the warm pool's tests
from cluster.local.replica import ManagedReplica, SupervisorConfig, free_port, kill_group  # noqa: F401
from cluster.local.warm_pool import WarmPool
from cluster.replica_plan import plan
from controlplane.backoff import restart_delay_s  # noqa: F401 - also used by the tests from here
from controlplane.schema import ReplicaRow, RevisionRow
from images.mounts import ImageMounts
from images.ref import ImageRef
from serving.runtime.registry import runtime_for

log = logging.getLogger("modelplane.supervisor")


def desired_counts(revisions: dict[str, RevisionRow]) -> dict[str, int]:
    """Each revision's desired replica count; 0 for one no longer active (failed, retired)."""
    return {rid: row.desired_replicas if row.state in ACTIVE_STATES else 0 for rid, row in revisions.items()}


def retiring_ids(revisions: dict[str, RevisionRow]) -> dict[str, list[str]]:
    """The replicas ``Cluster.scale`` named to stop first, per revision (``revisions.retiring``)."""
    return {rid: list(row.retiring or ()) for rid, row in revisions.items()}


class Supervisor:
    def __init__(self, engine: Engine, logs_dir: Path, config: SupervisorConfig = SupervisorConfig(),
                 mounts: ImageMounts | None = None, pool: WarmPool | None = None) -> None:
        self._engine = engine
        self._logs_dir = logs_dir
        self._config = config
        self.mounts = mounts  # None: every replica starts in place (images off)
        self.pool = pool  # None: every replica process starts cold
        self.replicas: dict[str, ManagedReplica] = {}

    def reconcile_once(self) -> None:
        with Session(self._engine) as session:
            revisions = {row.id: row for row in session.scalars(select(RevisionRow))}
        to_start, to_stop = plan(desired_counts(revisions), set(self.replicas), retiring_ids(revisions))
        self._stop_in_parallel([self.replicas.pop(replica_id) for replica_id in to_stop])
        for replica_id in to_stop:
            with Session(self._engine) as session, session.begin():
                session.execute(delete(ReplicaRow).where(ReplicaRow.id == replica_id))
        for replica_id, managed in list(self.replicas.items()):
            if not managed.watching:  # the thread is gone: its process may not be; stop it, start afresh
                log.error("replica %s: its watcher ended; starting it again", replica_id)
                managed.abandon()
                del self.replicas[replica_id]
                to_start.append(replica_id)
        for replica_id in to_start:
            revision = revisions[replica_id.rsplit("-", 1)[0]]
            try:
                managed = ManagedReplica(replica_id, revision, runtime_for(revision.runtime), self._engine,
                                         self._logs_dir, self._config, self.mounts, self.pool)
            except (KeyError, TypeError, ValueError) as exc:  # one bad revision must not block the others
                log.error("revision %s cannot start: %s", revision.id, exc)
                continue
            self.replicas[replica_id] = managed
            managed.start()

    def adopt_previous_run(self) -> None:
        """Take over the healthy replicas a previous supervisor left running; stop and forget the rest.

        Which of the healthy ones stay is :func:`plan` over them, as if this supervisor had
        been running them: a revision's replicas keep their ids (gaps left by victims too),
        and one still above its count stops its retiring replicas first.
        """
        with Session(self._engine) as session:
            revisions = {row.id: row for row in session.scalars(select(RevisionRow))}
            rows = list(session.scalars(select(ReplicaRow)))
        alive = {row.id: replica_process(row.pid, row.port) for row in rows}
        # A replica started from a serving image reads it through mount daemons that outlive a
        # killed supervisor (sessions of their own): it is adopted when its layers are still mounted.
        healthy_ids = {row.id for row in rows if alive[row.id] and row.state == "ready"
                       and row.revision_id in revisions and self._image_still_mounted(revisions[row.revision_id])
                       and healthy(f"http://{row.host}:{row.port}")}
        _, surplus = plan(desired_counts(revisions), healthy_ids, retiring_ids(revisions))
        for row in rows:
            if row.id in healthy_ids and row.id not in surplus:
                revision = revisions[row.revision_id]
                try:
                    managed = ManagedReplica(row.id, revision, runtime_for(revision.runtime), self._engine,
                                             self._logs_dir, self._config, self.mounts, self.pool)
                    managed.adopt(AdoptedProcess(row.pid), row.port, row.restarts)
                except (KeyError, TypeError, ValueError, psutil.Error) as exc:
                    log.error("replica %s cannot be adopted: %s", row.id, exc)
                else:
                    log.info("replica %s (pid %d) is healthy: adopted", row.id, row.pid)
                    self.replicas[row.id] = managed
                    managed.start()
                    continue
            if alive[row.id]:
                try:
                    os.killpg(row.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            with Session(self._engine) as session, session.begin():
                session.execute(delete(ReplicaRow).where(ReplicaRow.id == row.id))
        if self.mounts is not None:
            self.mounts.sweep()  # what the previous supervisor left mounted and no adopted replica reads

    def _image_still_mounted(self, revision: RevisionRow) -> bool:
        if not revision.image:
            return True
        return self.mounts is not None and self.mounts.mounted(ImageRef.from_json(revision.image))

    def run(self, stop: threading.Event) -> None:
        self.adopt_previous_run()
        while not stop.is_set():
            try:
                self.reconcile_once()
            except Exception:  # noqa: BLE001 - a database hiccup must not end supervision
                log.exception("reconcile failed; retrying")
            stop.wait(self._config.reconcile_interval_s)
        self.stop_all()

    def stop_all(self) -> None:
        self._stop_in_parallel(list(self.replicas.values()))
        self.replicas.clear()
        if self.pool is not None:
            self.pool.close()
        if self.mounts is not None:
            self.mounts.close()

    @staticmethod
    def _stop_in_parallel(replicas: list[ManagedReplica]) -> None:
        """Each replica drains for up to ``stop_grace_s``; they do it at the same time, not in turn."""
        threads = [threading.Thread(target=replica.stop) for replica in replicas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def main() -> None:
    from cluster.local.startup import image_mounts, warm_pool
    from controlplane.db import make_engine, upgrade
    from controlplane.settings import Settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe and scrape is noise
    settings = Settings.from_env()
    upgrade(settings.database_url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    liveness = settings.liveness()
    supervisor = Supervisor(make_engine(settings.database_url), settings.logs_dir / "replicas",
                            SupervisorConfig(host=settings.host, liveness=liveness), image_mounts(settings),
                            warm_pool(settings))
    log.info("supervisor running; a replica is hung after %g s of work without progress, or %g s without "
             "answering /metrics", liveness.hang_after_s, liveness.unanswered_after_s)
    supervisor.run(stop)


if __name__ == "__main__":
    main()
