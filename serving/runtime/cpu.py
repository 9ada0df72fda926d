"""How many CPUs this replica may use: the cgroup quota, not the host's core count.

A container limited to 2 CPUs on a 64-core host that sizes its thread pools from
``os.cpu_count()`` runs 64 threads on 2 CPUs' worth of time and thrashes. The quota is in
``/sys/fs/cgroup/cpu.max`` (cgroup v2: ``"<quota_us> <period_us>"`` or ``"max <period>"``)
or ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (cgroup v1).

Worked example: ``cpu.max`` = ``"150000 100000"`` → 1.5 CPUs → 1 thread for compute
(``threads_for(1.5) == 1``); ``"max 100000"`` → no quota → the CPUs this process may run on.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 ``cpu.max`` line, or None for no quota.

    >>> parse_cpu_max("200000 100000")
    2.0
    >>> parse_cpu_max("max 100000") is None
    True
    """
    quota, _, period = text.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def parse_cfs(quota_text: str, period_text: str) -> float | None:
    """CPUs allowed by cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1 = none)."""
    quota = int(quota_text.strip())
    return None if quota <= 0 else quota / int(period_text.strip())


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    v2 = root / "cpu.max"
    if v2.exists():
        return parse_cpu_max(v2.read_text())
    v1 = root / "cpu" / "cpu.cfs_quota_us"
    if v1.exists():
        return parse_cfs(v1.read_text(), (root / "cpu" / "cpu.cfs_period_us").read_text())
    return None


def available_cpus(root: Path = CGROUP_ROOT) -> float:
    """The quota when there is one, else the CPUs in this process's affinity mask."""
    affinity = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(root)
    return affinity if quota is None else min(quota, affinity)


def threads_for(cpus: float) -> int:
    """Compute threads for a CPU budget: whole CPUs, at least one."""
    return max(1, math.floor(cpus))
