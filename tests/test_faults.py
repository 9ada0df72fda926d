"""The fault table (``benchmarks.reliability``) on one running platform: each fault injected
under a request loop in a process of its own, each judged against its required result.

``make test-faults`` runs this module (``make test`` calls it): ``modelplane up`` with two
routers on PostgreSQL behind a gate, ``iris`` (3 pyfunc replicas, deployed through MLflow and
Dagster), ``smol`` (SmolLM2 on vLLM) and ``slow`` (a pyfunc model the autoscaler scales).
The tests run in the table's order; each leaves the platform as the next expects it. The
table of this run is written to ``$MODELPLANE_FAULTS_REPORT`` when that is set.

Each fault's property is proved at the shortest duration that still proves it
(:data:`benchmarks.reliability.table.QUICK`: a minute of saturation, the platform's liveness
bounds set shorter (``MODELPLANE_LIVENESS_*``: hung after 20 s, not 60) and a generation sized
past them); the long versions, with the figures quoted in docs/reliability.md, are
``python -m benchmarks.reliability`` without ``--quick``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.reliability.bed import FaultBed
from benchmarks.reliability.outcomes import FaultResult
from benchmarks.reliability.table import QUICK, bed_faults, markdown

pytestmark = [pytest.mark.slow, pytest.mark.faults]
FAULTS = dict(bed_faults(QUICK))
RESULTS: list[FaultResult] = []


@pytest.fixture(scope="module")
def bed(tmp_path_factory, request):
    from sqlalchemy import create_engine

    from benchmarks.reliability.bed import POSTGRES_ADMIN_URL

    try:
        create_engine(POSTGRES_ADMIN_URL).connect().close()
    except Exception as exc:  # noqa: BLE001 - any failure to connect means "no server here"
        if os.environ.get("CI"):
            raise
        pytest.skip(f"PostgreSQL at {POSTGRES_ADMIN_URL} is not reachable: {exc}")
    running = FaultBed(tmp_path_factory.mktemp("faults"), log=print, env=QUICK.liveness_env())
    try:
        yield running.start()
    finally:
        running.close()
        report = os.environ.get("MODELPLANE_FAULTS_REPORT")
        if report and RESULTS:
            Path(report).write_text(markdown(RESULTS) + "\n\n" + json.dumps([r.as_dict() for r in RESULTS], indent=1))


CASES = [
    pytest.param("sigkill_replica", id="SIGKILL one of three replicas under load: 0 failed requests"),
    pytest.param("sigstop_replica", id="SIGSTOP a replica: found within 30 s, replaced within 60 s, nothing hangs"),
    pytest.param("sigkill_router", id="SIGKILL one of two routers: clients that retry see at most 0.1% fail"),
    pytest.param("sigkill_supervisor", id="SIGKILL the supervisor: restarted, adopts the replicas, which keep serving"),
    pytest.param("sigkill_autoscaler", id="SIGKILL the autoscaler: restarted, no scale-down from lost history"),
    pytest.param("database_unreachable", id="database unreachable: routers serve, admin API 503, log counts losses"),
    pytest.param("bad_requests", id="a flood of bad requests: no ejection, restart or rollback, good traffic unharmed"),
    pytest.param("bad_tokens", id="a flood of unknown tokens: the database at its idle level, good traffic unharmed"),
    pytest.param("rollout", id="a rollout under load: 0 failed requests"),
    pytest.param("mlflow_down", id="MLflow down during registrations: each version deploys as its alias says"),
    pytest.param("long_generation", id="a generation past the hang bound on an idle replica is not taken for a hang"),
    pytest.param("saturation", id="a minute of saturation: excess refused with Retry-After, nothing restarted"),
]


def test_every_fault_of_the_table_is_a_case_in_its_order():
    assert [case.values[0] for case in CASES] == list(FAULTS)


def test_the_platform_runs_on_postgresql_and_both_routers_route_to_each_replica(bed):
    """The bed is `modelplane up --routers 2` on PostgreSQL with iris deployed by a Dagster run."""
    platform = bed.platform
    assert not (platform.home / "controlplane.db").exists()  # nothing went to SQLite
    assert "router-2 is up" in platform.log()
    platform.env["COLUMNS"] = "250"  # rich wraps its table at the terminal's width
    shown = platform.cli("router", "replicas", "--endpoint", "iris")
    routers = {line.split()[1] for line in shown.stdout.splitlines() if "iris-" in line}
    assert shown.returncode == 0 and len(routers) == 2, shown.stdout


@pytest.mark.parametrize("name", CASES)
def test_the_fault_meets_its_required_result(bed, name):
    result = FAULTS[name](bed)
    RESULTS.append(result)
    print(result.as_dict())
    assert result.passed, result.explain()
