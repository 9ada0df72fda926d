"""Faults of the control plane: the supervisor and the autoscaler killed, the database
unreachable, MLflow down during a burst of registrations. Each takes a started
:class:`FaultBed`, drives a request loop in a process of its own around the fault, and
returns the judged :class:`FaultResult`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import httpx
import psutil

from benchmarks.reliability.bed import FaultBed
from benchmarks.reliability.faults_serving import _loop, _no_failures
from benchmarks.reliability.load import until
from benchmarks.reliability.outcomes import FaultResult
from controlplane.scaling import AUTOSCALER_LEASE, Lease
from serving.runtime.scrape import samples_named

LOG_LOSS_METRICS = ("modelplane_router_inference_log_failed", "modelplane_router_inference_log_dropped")


def _replaced_process(bed: FaultBed, module: str, old_pid: int) -> psutil.Process | None:
    process = bed.platform.service_process(module)
    return process if process is not None and process.pid != old_pid else None


def sigkill_supervisor(bed: FaultBed) -> FaultResult:
    replicas = {r.replica_id: r.pid for endpoint in bed.targets for r in bed.replicas(endpoint) if r.state == "ready"}
    old = bed.platform.service_process("cluster.local.supervisor")
    log = bed.platform.home / "logs" / "supervisor.log"
    offset = log.stat().st_size
    with _loop(bed, "sigkill-supervisor", "iris") as loop:
        time.sleep(3)
        old.kill()
        fault_at = time.monotonic()
        detect_s = until(lambda: _replaced_process(bed, "cluster.local.supervisor", old.pid), 60)
        recover_s = until(lambda: "supervisor running" in log.read_bytes()[offset:].decode("utf-8", "replace"), 120,
                          since=fault_at)
        time.sleep(10)  # the new supervisor has looked at its replicas a few times
    tally = loop.tally()
    after = {r.replica_id: r.pid for endpoint in bed.targets for r in bed.replicas(endpoint) if r.state == "ready"}
    restarted = sorted(rid for rid, pid in replicas.items() if after.get(rid) != pid)
    return FaultResult.judged(
        "SIGKILL the supervisor", "replicas keep serving; the new supervisor adopts them", tally,
        {"replicas kept serving (0 failed requests)": _no_failures(tally),
         "the supervisor was restarted": recover_s is not None,
         "every replica adopted (same process, ready)": not restarted},
        detect_s=detect_s, recover_s=recover_s,
        notes=f"{len(replicas)} replicas of {len(bed.targets)} endpoints; restarted instead of adopted: "
              f"{restarted or 'none'}")


def _lease_holder(bed: FaultBed) -> str:
    held = Lease(bed.engine, AUTOSCALER_LEASE, "fault-table", ttl_s=10).holder_now()
    return held[0] if held else ""


def sigkill_autoscaler(bed: FaultBed, observe_s: float = 60.0) -> FaultResult:
    """``slow`` scaled up to 3 by a load of 6 in flight; the load drops to 1 and the autoscaler is
    killed at once: the new one, with no history, must not scale down within ``observe_s``."""
    with _loop(bed, "autoscaler-burst", "slow", concurrency=6, pause_s=0.0, deadline_s=60) as burst:
        scaled_s = until(lambda: bed.desired("slow") == 3 and bed.ready("slow") == 3, 120, 0.5)
    desired_before = bed.desired("slow")
    old = bed.platform.service_process("autoscale.controller")
    with _loop(bed, "sigkill-autoscaler", "slow", concurrency=1, pause_s=0.0, deadline_s=60) as loop:
        old.kill()
        fault_at = time.monotonic()
        detect_s = until(lambda: _replaced_process(bed, "autoscale.controller", old.pid), 60)
        new = _replaced_process(bed, "autoscale.controller", old.pid)
        recover_s = until(lambda: new is not None and _lease_holder(bed).endswith(f":{new.pid}"), 60, since=fault_at)
        seen = []
        deadline = time.monotonic() + observe_s
        while time.monotonic() < deadline:
            seen.append(bed.desired("slow"))
            time.sleep(1)
    tally, burst_tally = loop.tally(), burst.tally()
    return FaultResult.judged(
        "SIGKILL the autoscaler controller", "restarted; no scale-down from lost history", tally,
        {"scaled up to 3 before the fault": scaled_s is not None and desired_before == 3,
         "restarted and leading again": recover_s is not None,
         f"no scale-down for {observe_s:g} s after": bool(seen) and min(seen) >= desired_before,
         "0 failed requests": _no_failures(tally) and burst_tally.failed == burst_tally.lost == 0},
        detect_s=detect_s, recover_s=recover_s,
        notes=f"slow: 6 in flight at a target of 2 → {desired_before} replicas; then 1 in flight; desired after "
              f"the restart: min {min(seen, default=None)}, max {max(seen, default=None)}")


def _router_metric_ports(bed: FaultBed) -> list[int]:
    """Each router's own port (beside the shared one), where its /metrics is its own."""
    shared = bed.platform.ports["MODELPLANE_ROUTER_PORT"]
    ports = []
    for process in bed.platform.service_processes("serving.router.server"):
        with contextlib.suppress(psutil.Error):
            ports += [c.laddr.port for c in process.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN and c.laddr.port != shared]
    return ports


def routers_total(bed: FaultBed, names: tuple[str, ...], **labels: str) -> float:
    """The samples named ``names`` (with these ``labels``) summed over every router's own /metrics."""
    total = 0.0
    for port in _router_metric_ports(bed):
        page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        total += sum(sample.value for sample in samples_named(page, names)
                     if all(sample.labels.get(name) == value for name, value in labels.items()))
    return total


def _log_losses(bed: FaultBed) -> float:
    return routers_total(bed, LOG_LOSS_METRICS)


def database_unreachable(bed: FaultBed, outage_s: float = 10.0) -> FaultResult:
    """The database cut for ``outage_s`` under a request loop, with admin calls every 0.5 s. Both
    times count from the cut: *detect* until the admin API first answered 503 for it, *recover*
    until it answered 200 again after the database came back."""
    admin, headers = bed.platform.url("admin"), {"Authorization": f"Bearer {bed.admin_token}"}
    calls: list[tuple[float, float, int, str, str]] = []  # (sent s after the cut, took s, status, Retry-After, body)
    stop = threading.Event()

    def call_admin(cut_at: float) -> None:
        with httpx.Client(timeout=30, headers=headers) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    answer = (client.get(f"{admin}/endpoints") if len(calls) % 2 else
                              client.put(f"{admin}/endpoints/iris/traffic", json={"canary": None}))
                    calls.append((started - cut_at, time.monotonic() - started, answer.status_code,
                                  answer.headers.get("retry-after", ""), answer.text[:200]))
                except httpx.HTTPError as exc:
                    calls.append((started - cut_at, time.monotonic() - started, 0, "", repr(exc)[:200]))
                stop.wait(0.5)

    losses_before = _log_losses(bed)
    with _loop(bed, "database-unreachable", "iris") as loop:
        time.sleep(3)
        cut_wall = time.time()
        reset = bed.gate.cut()
        cut_at = time.monotonic()
        caller = threading.Thread(target=call_admin, args=(cut_at,), daemon=True)
        caller.start()
        time.sleep(outage_s)
        stop.set()
        caller.join(60)
        bed.gate.restore()
        restored_at = time.time()
        recover_s = until(lambda: httpx.get(f"{admin}/endpoints", headers=headers, timeout=10).status_code == 200, 60,
                          since=cut_at)
        time.sleep(5)  # the routers' next log batches go through
    tally = loop.tally()
    losses = _log_losses(bed) - losses_before
    during = list(calls)
    refused = [c for c in during if c[2] == 503 and c[3] and "database" in c[4]]
    from sqlalchemy import func, select

    from controlplane.schema import InferenceLogRow

    with bed.engine.connect() as connection:
        logged_after = connection.execute(select(func.count()).select_from(InferenceLogRow).where(
            InferenceLogRow.endpoint == "iris", InferenceLogRow.at >= _utc(restored_at + 1))).scalar_one()
    return FaultResult.judged(
        f"control-plane database unreachable for {outage_s:g} s",
        "routers keep serving; the admin API answers 503; the inference log drops and counts; nothing half-written "
        "afterwards", tally,
        {"routers kept serving (0 failed requests)": _no_failures(tally),
         "every admin call during the outage a 503 with Retry-After and a reason": bool(during)
         and len(refused) == len(during),
         "each within 10 s": all(c[1] <= 10 for c in during),
         "the inference log counted what it lost": losses > 0,
         "the inference log writes again after": logged_after > 0,
         "the admin API answers again": recover_s is not None},
        detect_s=min((sent + took for sent, took, *_ in refused), default=None), recover_s=recover_s,
        notes=f"{reset} database connections reset at the cut ({time.strftime('%H:%M:%S', time.localtime(cut_wall))}); "
              f"{len(during)} admin calls during it, the slowest answered in "
              f"{max((c[1] for c in during), default=0):.1f} s; {losses:.0f} log records lost and counted; "
              f"{logged_after} logged after; detect and recover counted from the cut")


def _utc(seconds: float):
    from datetime import datetime, timezone

    return datetime.fromtimestamp(seconds, tz=timezone.utc)


# Two versions registered and the alias moved twice (to the newer, then back to the older). The
# first version's line is printed as soon as it is registered: MLflow is stopped then, while the
# second registration and both alias moves are still to come.
BURST = ("import sys; from demo.iris import log_iris; from mlflow import MlflowClient;"
         "c = MlflowClient(sys.argv[1], sys.argv[1]); a = log_iris(sys.argv[1]); print('registered', a.version, flush=True);"
         "b = log_iris(sys.argv[1]); c.set_registered_model_alias('iris', 'champion', b.version);"
         "c.set_registered_model_alias('iris', 'champion', a.version); print(a.version, b.version)")


def mlflow_down_during_registrations(bed: FaultBed, down_s: float = 30.0) -> FaultResult:
    """A burst of registrations (:data:`BURST`) with MLflow stopped in the middle of it (SIGSTOP: its
    port accepts, nothing answers) for ``down_s``: the first version is registered, its webhook
    sent; the second version and both alias moves wait on the stopped server and land after it
    resumes. The alias ends on the older version, which must serve; the newer must never serve."""
    mlflow = bed.platform.service_process("mlflow")
    with _loop(bed, "mlflow-down", "iris") as loop:
        registering = bed.platform.start_registration(BURST)
        try:
            for line in registering.stdout:  # MLflow prints its own lines too ("View run … at …")
                if line.startswith("registered "):
                    break
            else:
                raise RuntimeError(f"the registrations failed:\n{registering.communicate(timeout=60)[1][-3000:]}")
            os.killpg(mlflow.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                time.sleep(down_s)
                still_registering = registering.poll() is None  # its next calls wait on the stopped server
            finally:
                os.killpg(mlflow.pid, signal.SIGCONT)
            rest, errors = registering.communicate(timeout=300)
        finally:
            if registering.poll() is None:
                registering.kill()
        if registering.returncode != 0:
            raise RuntimeError(f"the registrations failed after MLflow came back:\n{errors[-3000:]}")
        older, newer = rest.split()[-2:]
        serves = lambda: _partition(bed) == f"iris.v{older}" and bed.ready("iris") >= 3  # noqa: E731
        recover_s = until(serves, 900, 2.0, since=stopped_at)
        time.sleep(3)
    tally = loop.tally()
    newer_served = [r for r in bed.platform.runs(f"iris.v{newer}") if r["status"] == "SUCCESS"]
    return FaultResult.judged(
        "MLflow down during a burst of registrations", "each version deploys when it is back, exactly as its alias says",
        tally,
        {"MLflow stopped while registrations were still arriving": still_registering,
         f"v{older} (the alias) serves once MLflow is back": recover_s is not None,
         f"no revision of v{newer} serves (its alias moved away)": _partition(bed) == f"iris.v{older}"
         and not _served_partition(bed, f"iris.v{newer}"),
         "0 failed requests meanwhile": _no_failures(tally)},
        recover_s=recover_s,
        notes=f"v{older} registered, then MLflow stopped {down_s:g} s while v{newer} and the alias moves "
              f"(champion → v{newer} → v{older}) waited on it; deploy runs of v{newer}: "
              f"{len(bed.platform.runs(f'iris.v{newer}'))} ({len(newer_served)} succeeded)")


def _partition(bed: FaultBed) -> str:
    from controlplane.revisions import RevisionStore

    return RevisionStore(bed.engine).get(bed.serving("iris")).partition_key


def _served_partition(bed: FaultBed, partition: str) -> list[str]:
    """Revisions of ``partition`` that serve now."""
    from sqlalchemy import select

    from controlplane.schema import RevisionRow

    with bed.engine.connect() as connection:
        return list(connection.execute(select(RevisionRow.id).where(RevisionRow.partition_key == partition,
                                                                    RevisionRow.state == "serving")).scalars())
