"""CPU utilization of the local backend's replicas, for the vertical axis.

A replica's utilization over the last interval = the CPU seconds its process tree used
(user + system, children included: vLLM's engine core and workers, pyfunc's workers)
divided by the wall seconds elapsed and by the CPUs a replica may use (the cgroup quota:
``serving.runtime.cpu.available_cpus``). Worked example: 27 CPU seconds in 30 s on 2 CPUs
is 0.45. The first read of a replica has no interval yet and gives nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from controlplane.schema import ReplicaRow
from serving.runtime.cpu import available_cpus


def utilization(cpu_s_before: float, cpu_s_now: float, wall_s: float, cpus: float) -> float | None:
    """Share of ``cpus`` used between two reads, within [0, 1]; None without an interval.

    >>> utilization(100.0, 127.0, 30.0, 2.0)
    0.45
    >>> utilization(100.0, 127.0, 0.0, 2.0) is None
    True
    """
    if wall_s <= 0 or cpus <= 0:
        return None
    return round(min(1.0, max(0.0, (cpu_s_now - cpu_s_before) / wall_s / cpus)), 4)


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of a process and its children; None once it is gone."""
    try:
        process = psutil.Process(pid)
        total = sum(process.cpu_times()[:2])
        for child in process.children(recursive=True):
            try:
                total += sum(child.cpu_times()[:2])
            except psutil.Error:
                continue
        return total
    except psutil.Error:
        return None


class LocalCpu:
    """Reads the replicas' pids from the supervisor's rows and keeps the last reading of each."""

    def __init__(self, engine: Engine, cpus: float | None = None, now: Callable[[], float] = time.monotonic) -> None:
        self._engine, self._cpus, self._now = engine, cpus if cpus is not None else available_cpus(), now
        self._last: dict[int, tuple[float, float]] = {}  # pid → (cpu seconds, when)

    def mean_utilization(self, replica_urls: list[str]) -> float | None:
        wanted = set(replica_urls)
        with Session(self._engine) as session:
            rows = session.scalars(select(ReplicaRow).where(ReplicaRow.state == "ready")).all()
        pids = [row.pid for row in rows if row.pid and f"http://{row.host}:{row.port}" in wanted]
        values = []
        for pid in pids:
            cpu_s, at = tree_cpu_s(pid), self._now()
            if cpu_s is None:
                continue
            if pid in self._last:
                value = utilization(self._last[pid][0], cpu_s, at - self._last[pid][1], self._cpus)
                if value is not None:
                    values.append(value)
            self._last[pid] = (cpu_s, at)
        for pid in set(self._last) - set(pids):  # replicas that left
            del self._last[pid]
        return sum(values) / len(values) if values else None
