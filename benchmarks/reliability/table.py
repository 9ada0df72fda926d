"""The fault table, in the order it runs on one :class:`FaultBed`.

The order matters only for the state each fault leaves: the replica faults need ``iris`` at
three ready replicas (each waits for its own recovery), the rollout and the MLflow burst move
``iris`` to new versions, the long generation needs ``smol`` idle, and saturation comes last
among the LLM faults so that its queue has drained before anything else reads ``smol``. The
registry fault needs no platform.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from benchmarks.reliability import faults_clients, faults_control, faults_serving
from benchmarks.reliability.bed import FaultBed
from benchmarks.reliability.outcomes import FaultResult


@dataclass(frozen=True)
class Durations:
    """How long each timed fault lasts, and the liveness bounds the bed's platform runs with
    (``MODELPLANE_LIVENESS_HANG_AFTER_S`` and ``_UNANSWERED_AFTER_S``): the long generation is
    sized past ``hang_after_s``, and a stopped replica is found by ``unanswered_after_s``."""

    saturation_s: float
    long_generation_s: float
    autoscaler_observe_s: float
    mlflow_down_s: float
    client_flood_s: float  # each of a client-fault row's two windows: before the flood, during it
    hang_after_s: float
    unanswered_after_s: float

    def liveness_env(self) -> dict[str, str]:
        return {"MODELPLANE_LIVENESS_HANG_AFTER_S": f"{self.hang_after_s:g}",
                "MODELPLANE_LIVENESS_UNANSWERED_AFTER_S": f"{self.unanswered_after_s:g}"}


# The platform's own defaults (60 s, 20 s), with the durations docs/reliability.md quotes.
FULL = Durations(saturation_s=300.0, long_generation_s=150.0, autoscaler_observe_s=60.0, mlflow_down_s=30.0,
                 client_flood_s=60.0, hang_after_s=60.0, unanswered_after_s=20.0)
# What ``make test`` runs: each property at the shortest duration that still proves it. The
# liveness bounds are settings; shorter ones prove the same rules in a third of the time.
QUICK = Durations(saturation_s=60.0, long_generation_s=30.0, autoscaler_observe_s=30.0, mlflow_down_s=15.0,
                  client_flood_s=15.0, hang_after_s=20.0, unanswered_after_s=10.0)


def bed_faults(durations: Durations) -> list[tuple[str, Callable[[FaultBed], FaultResult]]]:
    return [
        ("sigkill_replica", faults_serving.sigkill_one_of_three_replicas),
        ("sigstop_replica", faults_serving.sigstop_one_replica),
        ("sigkill_router", faults_serving.sigkill_one_of_two_routers),
        ("sigkill_supervisor", faults_control.sigkill_supervisor),
        ("sigkill_autoscaler", partial(faults_control.sigkill_autoscaler, observe_s=durations.autoscaler_observe_s)),
        ("database_unreachable", faults_control.database_unreachable),
        ("bad_requests", partial(faults_clients.bad_requests, duration_s=durations.client_flood_s)),
        ("bad_tokens", partial(faults_clients.bad_tokens, duration_s=durations.client_flood_s)),
        ("rollout", faults_serving.rollout_under_load),
        ("mlflow_down", partial(faults_control.mlflow_down_during_registrations, down_s=durations.mlflow_down_s)),
        ("long_generation", partial(faults_serving.long_generation, target_s=durations.long_generation_s,
                                    hang_after_s=durations.hang_after_s)),
        ("saturation", partial(faults_serving.saturation, duration_s=durations.saturation_s)),
    ]


def run_table(root: Path, durations: Durations, only: set[str] | None = None,
              log: Callable[[str], None] = print) -> Iterator[FaultResult]:
    """Every fault (or those named in ``only``), each result as soon as it is judged. A fault
    that raises is a failed row, and the next one runs."""
    from benchmarks.reliability.registry_fault import registry_stopped_during_lazy_read

    chosen = [(name, fault) for name, fault in bed_faults(durations) if not only or name in only]
    if chosen:
        bed = FaultBed(root / "bed", log, env=durations.liveness_env())
        try:
            bed.start()
            for name, fault in chosen:
                log(f"fault: {name}")
                yield _guarded(name, lambda: fault(bed))
        finally:
            bed.close()
    if not only or "registry" in only:
        log("fault: registry")
        yield _guarded("registry", lambda: registry_stopped_during_lazy_read(root / "registry", log=log))


def _guarded(name: str, run: Callable[[], FaultResult]) -> FaultResult:
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - the row says what broke; the table goes on
        return FaultResult(fault=name, required="(see the fault's docstring)", passed=False,
                           checks={"ran to its end": False}, notes=f"{type(exc).__name__}: {exc}"[:500])


def markdown(results: list[FaultResult]) -> str:
    def cell(value) -> str:
        return "–" if value is None else f"{value:g}" if isinstance(value, float) else str(value)

    lines = ["| fault | required | sent | ok | refused | failed | lost | detect s | recover s | met |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.fault} | {r.required} | {r.sent} | {r.ok} | {r.refused} | {r.failed} | {r.lost} | "
                     f"{cell(r.detect_s)} | {cell(r.recover_s)} | {'yes' if r.passed else 'NO'} |")
    return "\n".join(lines)
