"""CPU utilization of local replicas: CPU seconds of the process tree over wall seconds and CPUs."""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone

from controlplane.schema import ReplicaRow, RevisionRow
from autoscale.controller.local_cpu import LocalCpu, tree_cpu_s


def add_replica(engine, pid: int, port: int) -> str:
    from sqlalchemy.orm import Session

    now = datetime.now(timezone.utc)
    with Session(engine) as session, session.begin():
        if session.get(RevisionRow, "r") is None:
            session.add(RevisionRow(id="r", endpoint="e", partition_key="e.v1", model_dir="/m", runtime="pyfunc",
                                    runtime_config={}, desired_replicas=1, state="serving", created_at=now,
                                    updated_at=now))
        session.add(ReplicaRow(id=f"r-{port}", revision_id="r", host="127.0.0.1", port=port, pid=pid, state="ready",
                               restarts=0, updated_at=now))
    return f"http://127.0.0.1:{port}"


def test_a_busy_replica_reads_as_used_and_an_unknown_one_reads_as_nothing(migrated_engine):
    url = add_replica(migrated_engine, os.getpid(), 9001)  # this test's own process stands in for a replica
    cpu = LocalCpu(migrated_engine, cpus=1.0)
    assert cpu.mean_utilization([url]) is None  # no interval yet
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # spin: this process uses its CPU
        pass
    used = cpu.mean_utilization([url])
    assert used is not None and 0.0 < used <= 1.0  # how much depends on what else the machine runs
    assert cpu.mean_utilization(["http://127.0.0.1:1"]) is None


def test_a_process_that_is_gone_has_no_cpu_time():
    assert tree_cpu_s(2 ** 22 + 12345) is None
