"""Faults of the serving path: replicas and routers killed or stopped, saturation, a long
generation, a rollout under load. Each takes a started :class:`FaultBed`, drives a request loop
in a process of its own around the fault, and returns the judged :class:`FaultResult`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import psutil

from benchmarks.reliability.bed import ROUTERS, SMOL_QUEUED, SMOL_RUNNING, FaultBed, ReplicaState
from benchmarks.reliability.load import RequestLoop, Target, until
from benchmarks.reliability.outcomes import FaultResult, Tally
from benchmarks.reliability.platform import REGISTER_IRIS


def _loop(bed: FaultBed, name: str, endpoint: str, **options) -> RequestLoop:
    return RequestLoop(bed.targets[endpoint], bed.work / f"{name}.jsonl", **options)


def _no_failures(tally: Tally) -> bool:
    return tally.sent > 0 and tally.failed == tally.lost == tally.refused == 0


def _replaced(bed: FaultBed, endpoint: str, victim: ReplicaState, count: int) -> bool:
    replicas = {r.replica_id: r for r in bed.replicas(endpoint)}
    now = replicas.get(victim.replica_id)
    return (sum(r.state == "ready" for r in replicas.values()) >= count and now is not None
            and now.state == "ready" and now.pid != victim.pid)


def _left_ready(bed: FaultBed, endpoint: str, victim: ReplicaState) -> bool:
    now = {r.replica_id: r for r in bed.replicas(endpoint)}.get(victim.replica_id)
    return now is None or now.state != "ready" or now.pid != victim.pid


def sigkill_one_of_three_replicas(bed: FaultBed) -> FaultResult:
    ready = [r for r in bed.replicas("iris") if r.state == "ready"]
    victim = ready[0]
    with _loop(bed, "sigkill-replica", "iris") as loop:
        time.sleep(3)
        os.killpg(victim.pid, signal.SIGKILL)
        fault_at = time.monotonic()
        detect_s = until(lambda: _left_ready(bed, "iris", victim), 60, 0.05)
        recover_s = until(lambda: _replaced(bed, "iris", victim, len(ready)), 120, since=fault_at)
        time.sleep(3)
    tally = loop.tally()
    return FaultResult.judged(
        "SIGKILL one of three replicas under load", "0 failed requests", tally,
        {"0 failed requests": _no_failures(tally), "three replicas ready again": recover_s is not None},
        detect_s=detect_s, recover_s=recover_s, notes=f"{len(ready)} ready replicas before; killed {victim.replica_id}")


def sigstop_one_replica(bed: FaultBed, deadline_s: float = 45.0) -> FaultResult:
    ready = [r for r in bed.replicas("iris") if r.state == "ready"]
    victim = ready[1]
    try:
        with _loop(bed, "sigstop-replica", "iris", deadline_s=deadline_s) as loop:
            time.sleep(3)
            os.killpg(victim.pid, signal.SIGSTOP)  # a silent hang: alive, accepting connections, answering nothing
            fault_at = time.monotonic()
            detect_s = until(lambda: _left_ready(bed, "iris", victim), 90, 0.1)
            recover_s = until(lambda: _replaced(bed, "iris", victim, len(ready)), 150, since=fault_at)
            time.sleep(3)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(victim.pid, signal.SIGCONT)  # if it was never replaced, let it go on
    tally = loop.tally()
    unclear = [r for r in loop.records() if r.outcome == "failed" and not (r.status >= 400 and r.detail.strip())]
    return FaultResult.judged(
        "SIGSTOP one replica (a silent hang)",
        "detected ≤ 30 s, replaced ≤ 60 s, every request answered or failed with a clear error, none hangs past its "
        "deadline", tally,
        {"detected ≤ 30 s": detect_s is not None and detect_s <= 30,
         "replaced ≤ 60 s": recover_s is not None and recover_s <= 60,
         "every failure an error answer with a reason": not unclear,
         f"none hung past its deadline ({deadline_s:g} s)": tally.lost == 0},
        detect_s=detect_s, recover_s=recover_s,
        notes=f"client deadline {deadline_s:g} s; failures: "
              f"{sorted({(r.status, r.detail[:80]) for r in loop.records() if r.outcome != 'ok'})[:3]}")


def _router_port_connections(process: psutil.Process, port: int) -> int:
    with contextlib.suppress(psutil.Error):
        return sum(1 for c in process.net_connections(kind="inet")
                   if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port)
    return 0


def _listening(process: psutil.Process, port: int) -> bool:
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in process.net_connections(kind="inet"))


def sigkill_one_of_two_routers(bed: FaultBed) -> FaultResult:
    port = bed.platform.ports["MODELPLANE_ROUTER_PORT"]
    with _loop(bed, "sigkill-router", "iris", concurrency=8, pause_s=0.01, retries=3) as loop:
        time.sleep(3)
        routers = bed.platform.service_processes("serving.router.server")
        victim = max(routers, key=lambda p: _router_port_connections(p, port))
        held = _router_port_connections(victim, port)
        victim.kill()
        fault_at = time.monotonic()
        others = {p.pid for p in routers} - {victim.pid}
        fresh = lambda: [p for p in bed.platform.service_processes("serving.router.server")  # noqa: E731
                         if p.pid not in others and p.pid != victim.pid]
        detect_s = until(lambda: fresh(), 60)
        recover_s = until(lambda: fresh() and _listening(fresh()[0], port), 90, since=fault_at)
        time.sleep(5)
    tally = loop.tally()
    return FaultResult.judged(
        "two routers, SIGKILL one", "clients that retry see ≤ 0.1% failures", tally,
        {"≤ 0.1% failures": tally.sent > 0 and tally.failure_rate() <= 0.001,
         "the router was restarted": recover_s is not None},
        detect_s=detect_s, recover_s=recover_s,
        notes=f"{len(routers)} routers; the killed one held {held} of the 8 clients' connections; clients retry up "
              f"to 3 times; {sum(r.attempts > 1 for r in loop.records())} requests retried")


def rollout_under_load(bed: FaultBed) -> FaultResult:
    before = bed.serving("iris")
    with _loop(bed, "rollout", "iris") as loop:
        time.sleep(3)
        started = time.monotonic()
        version = bed.platform.register(REGISTER_IRIS + "; print(v.version)").split()[-1]
        run = bed.platform.finished_run(f"iris.v{version}", 600)
        recover_s = until(lambda: bed.serving("iris") != before and bed.ready("iris") >= 3, 120, since=started)
        time.sleep(3)
    tally = loop.tally()
    return FaultResult.judged(
        "rollout of a new version under load", "0 failed requests", tally,
        {"0 failed requests": _no_failures(tally), "the new version serves": run["status"] == "SUCCESS"
         and bed.serving("iris") != before},
        recover_s=recover_s, notes=f"iris v{version} registered and aliased champion; registration to serving "
                                   "(the deploy run's cost sweep included) is the recover time")


def _completion(bed: FaultBed, max_tokens: int, timeout_s: float) -> tuple[int, int | None, float]:
    """(status, completion tokens, seconds) of one completion; status 0 when no answer came."""
    target: Target = bed.targets["smol"]
    body = {**target.body, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    started = time.monotonic()
    try:
        response = httpx.post(target.url, json=body, headers=target.headers, timeout=timeout_s)
    except httpx.HTTPError:
        return 0, None, time.monotonic() - started
    tokens = response.json().get("usage", {}).get("completion_tokens") if response.status_code == 200 else None
    return response.status_code, tokens, time.monotonic() - started


def long_generation(bed: FaultBed, target_s: float = 150.0, hang_after_s: float = 60.0,
                    attempts: int = 3) -> FaultResult:
    """One request generating for about ``target_s`` on the idle replica, sized from a short one.

    A generation that ends before ``hang_after_s`` proves nothing (the decode rate measured on a
    busy machine can be far below the rate the long one then gets), so it is sent again, sized
    from the rate that generation itself showed, up to ``attempts`` times.
    """
    [before] = bed.replicas("smol")
    _, _, short_s = _completion(bed, 16, 120)  # the decode rate, without the prompt and the request's overhead
    status, _, long_s = _completion(bed, 144, 120)
    rate = 128 / max(long_s - short_s, 0.1) if status == 200 else 20.0
    runs: list[str] = []
    for _ in range(attempts):
        tokens = int(min(7800, max(200, rate * target_s)))
        status, generated, took_s = _completion(bed, tokens, target_s * 4 + 300)
        runs.append(f"{tokens} tokens in {took_s:.0f} s (sized at {rate:.0f} tok/s)")
        if status != 200 or generated != tokens or took_s > hang_after_s or tokens == 7800:
            break
        rate = tokens / took_s
    [after] = bed.replicas("smol")
    supervisor_log = (bed.platform.home / "logs" / "supervisor.log").read_text(errors="replace")
    tally = Tally(sent=len(runs), ok=len(runs) - int(status != 200), refused=0,
                  failed=int(status not in (0, 200)), lost=int(status == 0),
                  max_latency_s=took_s, first_bad_s=None, last_bad_s=None)
    return FaultResult.judged(
        "a long generation on an otherwise idle replica", "not restarted", tally,
        {"answered whole": generated == tokens,
         f"the platform's hang bound is {hang_after_s:g} s": f"hung after {hang_after_s:g} s of work" in supervisor_log,
         f"it outlasted the hang bound ({hang_after_s:g} s)": took_s > hang_after_s,
         "the replica was not restarted": (after.pid, after.restarts) == (before.pid, before.restarts)},
        notes="; ".join(runs) + f"; status {status}")


def saturating_clients(routers: int, admitted_per_router: int) -> int:
    """Closed-loop clients enough that some router is offered twice what it admits, however the
    kernel splits their keep-alive connections among routers that share one port.

    With ``routers × admitted`` clients an even split fills each router exactly and refuses
    nothing (a CI run did just that); with twice as many, one router holds at least twice its
    share (pigeonhole).

    >>> saturating_clients(2, 8)
    32
    """
    return 2 * routers * admitted_per_router


def saturation(bed: FaultBed, duration_s: float = 300.0, deadline_s: float = 120.0) -> FaultResult:
    """Clients enough that some router is offered twice what it admits to ``smol``
    (``SMOL_RUNNING`` running + ``SMOL_QUEUED`` queued), for ``duration_s``. A request not
    answered within the clients' ``deadline_s`` is a timeout (lost)."""
    [before] = bed.replicas("smol")
    clients = saturating_clients(ROUTERS, SMOL_RUNNING + SMOL_QUEUED)
    port = bed.platform.ports["MODELPLANE_ROUTER_PORT"]
    target = bed.targets["smol"]
    saturating = Target(target.name, target.url, {**target.body, "max_tokens": 32, "ignore_eos": True}, target.headers)
    with RequestLoop(saturating, bed.work / "saturation.jsonl", concurrency=clients, pause_s=0.2,
                     deadline_s=deadline_s) as loop:
        time.sleep(min(10.0, duration_s))
        routers = bed.platform.service_processes("serving.router.server")
        split = sorted((_router_port_connections(router, port) for router in routers), reverse=True)
        time.sleep(max(0.0, duration_s - 10.0))
    tally = loop.tally()
    [after] = bed.replicas("smol")
    statuses = sorted({r.status for r in loop.records()})
    return FaultResult.judged(
        f"{duration_s / 60:g} min at full saturation (offered load > capacity)",
        f"0 liveness restarts; excess load refused with 429/503 and Retry-After, never a timeout (client deadline "
        f"{deadline_s:g} s)", tally,
        {"0 liveness restarts": (after.pid, after.restarts) == (before.pid, before.restarts),
         "offered load exceeded capacity (some refused)": tally.refused > 0,
         "every refusal a 429/503 with Retry-After, no other failure": tally.failed == 0,
         f"no timeout (none unanswered after the clients' {deadline_s:g} s deadline)": tally.lost == 0},
        notes=f"{clients} clients, 32 tokens each, against {SMOL_RUNNING} running + {SMOL_QUEUED} queued per router; "
              f"connections per router {'/'.join(map(str, split))}; statuses {statuses}; "
              f"slowest answer {tally.max_latency_s:.1f} s")
