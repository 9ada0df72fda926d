"""Fidelity of the fleet simulator: the same demand on real local replicas and in ``autoscale.sim``.

    .venv/bin/python -m benchmarks.sim_fidelity [--quick] --json OUT.json

**What runs for real.** ``benchmarks.autoscale_harness``: the local backend's supervisor
starting real pyfunc replica processes, a real router and the real autoscaler controller
(``autoscale.controller.loop.Controller`` with its real adapters, on the wall clock). Each
replica serves ``demo.service_time_model`` at ``SERVICE_TIME_MS`` (50 ms) a row, one worker,
``max_batch_size`` 1: a request of r rows holds its replica for r × 50 ms.

**The tiny LLM is not used** (the issue asks for it; not done). On this 2-core machine every
vLLM replica of ``demo.tiny_llama`` computes on the same cores (``vllm_runtime.bind_cpus``
binds each replica's OpenMP threads to the *first* allowed cores, the same ones for every
replica), so a second or third replica adds no capacity: scaling out would change nothing the
simulator's per-replica model (independent replicas) is meant to predict, and the comparison
would measure CPU contention.
Each vLLM start-up also takes 30-50 s of both cores, and the harness deploys pyfunc revisions
only (a vLLM revision needs its own deploy path there). The service-time replica keeps replicas
independent (its cost is a sleep), which is what the simulator assumes; the LLM comparison
needs a machine with a core set (or an accelerator) per replica. The JSON's ``notes`` say so.

In one run:

1. **Calibration.** An endpoint pinned to one replica (min = max = 1) is swept with closed
   loops at concurrency 1, 2 and 4, requests of 1-4 rows; each level is fitted as
   ``latency = α·rows + γ`` (``fit_rows_level``; β = 0: the rows stand in the cost model's
   input tokens, the output tokens are 0), and ``costmodel.fit.target_concurrency`` picks
   the level that holds the SLO. That is the ``costmodel.fit.CostModel`` the simulator's
   ``ReplicaModel`` is built from. Cold start (order → ready, as the supervisor reports it):
   the calibration endpoint's first replica and the measured endpoint's first replica.
2. **Demand** (``fidelity_demand``): per-second arrival counts of the Azure LLM trace 2023
   (conversation service) from its start, rate-scaled to a mean of ``base_rps``, ×
   ``step_factor`` between ``step_at_s`` and ``step_end_s`` (the step that makes the
   autoscaler add replicas, then the drop that lets it scale down); counts are Poisson draws
   (seeded). Each request takes the size of a trace request in order:
   ``rows = clamp(ceil(ContextTokens / median ContextTokens), 1, 4)`` (the trace's median
   prompt is one row, 50 ms; 50 % one row, 36 % two, 5 % three, 9 % four, mean 1.73).
   Sent open-loop: each second's requests at uniform random times within it (seeded),
   without waiting for answers.
3. **Measured endpoint**: min 1, max 3 replicas, ``target_concurrency`` 2 pinned; the
   controller's ``scale_down_window_s`` is shortened (``Timing.lookback_s``) so the scale-down
   falls inside the run. Replica counts polled every 0.25 s.
4. **Simulator**: ``Demand`` with the same per-second arrivals and the sent sizes,
   ``ReplicaModel(cost model)``, ``ColdStart`` from the measured cold starts,
   ``ModelplanePolicy("horizontal")`` with the same min/max/target and the same
   ``ControllerConfig``; ``fleet.simulate``. Its latencies (``sim_latencies``): each served
   chunk's whole-second wait plus every size's service latency at the tick's concurrency,
   weighted by the sizes' shares.

Headline ratio = predicted p99 / measured p99 over all requests; goal within [0.67, 1.5].
Also: p50 ratio, per-phase p50/p99 (before, during and after the step), and the replica
counts over time (ready, and ready + starting) as mean absolute and max differences per
second.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import httpx
import numpy as np

from autoscale.controller.loop import ControllerConfig
from autoscale.sim.demand import read_trace
from costmodel.fit import CostModel
from costmodel.sweep import RequestSample, SweepPoint, nearest_rank_percentile
from benchmarks.sim_fidelity_figures import (
    FULL, MAX_REPLICAS, MIN_REPLICAS, TARGET_CONCURRENCY, FidelityDemand, GOAL, MAX_ROWS, QUICK, SERVICE_TIME_MS, SLO_P99_MS, SWEEP_LEVELS, TRACE_CSV, Timing,
    compare, fidelity_demand, percentiles, phases, rows_cost_model, sim_latencies, step_series,
    verdict)

def log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


# ---- real side -----------------------------------------------------------------------------------

def body(rows: int) -> dict:
    return {"dataframe_split": {"columns": ["x"], "data": [[1.0]] * int(rows)}}


def sweep(endpoint, levels: tuple[int, ...], seconds: float) -> tuple[list[RequestSample], list[SweepPoint]]:
    """Closed loops at each level on one replica; sizes 1..MAX_ROWS in turn (client k starts at k)."""
    samples: list[RequestSample] = []
    points: list[SweepPoint] = []
    for c in levels:
        stop = threading.Event()
        level: list[RequestSample] = []

        def client(k: int) -> None:
            with httpx.Client(timeout=60) as http:
                n = k
                while not stop.is_set():
                    rows = n % MAX_ROWS + 1
                    n += 1
                    started = time.monotonic()
                    try:
                        ok = http.post(endpoint.url, json=body(rows), headers=endpoint.headers).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    level.append(RequestSample(rows, 0, c, (time.monotonic() - started) * 1000.0, None, ok))
        started = time.monotonic()
        with ThreadPoolExecutor(c) as pool:
            for k in range(c):
                pool.submit(client, k)
            time.sleep(seconds)
            stop.set()
        wall_s = time.monotonic() - started
        samples += level
        for rows in range(1, MAX_ROWS + 1):
            of_shape = [s for s in level if s.input_tokens == rows]
            if of_shape:
                points.append(SweepPoint.aggregate(of_shape, wall_s))
        log(f"sweep c={c}: {len(level)} requests, mean {np.mean([s.latency_ms for s in level]):.0f} ms")
    return samples, points


def replay_real(platform, endpoint, demand: FidelityDemand, duration_s: int) -> dict:
    """Send the demand open-loop; poll the replica counts every 0.25 s until every answer is in."""
    answers: list[tuple[float, float, int]] = []  # (scheduled send, latency ms, status)
    ready_changes: list[tuple[float, int]] = []
    total_changes: list[tuple[float, int]] = []
    done = threading.Event()
    http = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
    start = time.monotonic() + 1.0
    start_wall_s = time.time() + 1.0

    def send(at_s: float, rows: int) -> None:
        sent = time.monotonic()
        try:
            status = http.post(endpoint.url, json=body(rows), headers=endpoint.headers).status_code
        except httpx.HTTPError:
            status = 0
        answers.append((at_s, (time.monotonic() - sent) * 1000.0, status))

    def poll() -> None:
        while not done.is_set():
            now = time.monotonic() - start
            ready, total = endpoint.ready(), endpoint.served_by()
            if not ready_changes or ready_changes[-1][1] != ready:
                ready_changes.append((now, ready))
            if not total_changes or total_changes[-1][1] != total:
                total_changes.append((now, total))
            done.wait(0.25)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    late = []
    with ThreadPoolExecutor(256) as pool:
        for at_s, rows in zip(demand.send_at_s.tolist(), demand.rows.tolist()):
            delay = start + at_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                late.append(-delay)
            pool.submit(send, at_s, rows)
        log(f"all {len(demand.rows)} requests sent; waiting for the answers")
        remaining = start + duration_s - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        done_sending = time.monotonic()
    done.set()
    poller.join(5)
    http.close()
    ticks = len(demand.arrivals)
    return {"answers": answers, "ready": step_series(ready_changes, ticks, initial=1),
            "total": step_series(total_changes, ticks, initial=1), "ready_changes": ready_changes,
            "send_lateness_ms": {"max": round(max(late, default=0.0) * 1000, 1),
                                 "p99": round(nearest_rank_percentile(late, 0.99) * 1000, 1) if late else 0.0},
            "drain_after_end_s": round(time.monotonic() - done_sending, 1), "start_wall_s": start_wall_s}


def run_real(timing: Timing, demand: FidelityDemand) -> dict:
    from benchmarks.autoscale_harness import Platform

    controller_config = ControllerConfig(scale_down_window_s=timing.lookback_s)
    with tempfile.TemporaryDirectory(prefix="sim-fidelity-") as tmp:
        platform = Platform(Path(tmp), controller_config, service_time_ms=SERVICE_TIME_MS, log=log)
        try:
            platform.start_controller()
            calib = platform.deploy("name: calib\nmodel: models:/calib@champion\nscaling: {min_replicas: 1, "
                                    "max_replicas: 1, target_concurrency: 2}\n")
            log(f"calibration endpoint up (cold start {calib.cold_start_s:.2f} s); sweeping")
            samples, points = sweep(calib, SWEEP_LEVELS, timing.sweep_s)
            platform.undeploy(calib)
            endpoint = platform.deploy(f"name: fid\nmodel: models:/fid@champion\nscaling: {{min_replicas: "
                                       f"{MIN_REPLICAS}, max_replicas: {MAX_REPLICAS}, target_concurrency: "
                                       f"{TARGET_CONCURRENCY}}}\n")
            log(f"measured endpoint up (cold start {endpoint.cold_start_s:.2f} s); replaying "
                f"{len(demand.rows)} requests over {timing.duration_s} s")
            time.sleep(2.0)
            replayed = replay_real(platform, endpoint, demand, timing.duration_s)
            decisions = [f"{d.at.timestamp() - replayed['start_wall_s']:+.1f} s {d.axis} {d.rule} → {d.replicas}: "
                         f"{d.reason}" for d in reversed(platform.decisions.recent("fid", limit=50))]
            platform.undeploy(endpoint)
        finally:
            platform.close()
    return {"samples": samples, "points": points, "cold_starts_s": [calib.cold_start_s, endpoint.cold_start_s],
            "decisions": decisions, **replayed}


# ---- simulator side ------------------------------------------------------------------------------

def run_sim(demand: FidelityDemand, cost: CostModel, cold_starts_s: list[float], timing: Timing):
    from autoscale.sim.fleet import FleetConfig, simulate
    from autoscale.sim.modelplane import ModelplanePolicy
    from autoscale.sim.replica import ColdStart, ReplicaModel

    sim_demand = demand.to_sim()
    model = ReplicaModel(cost, sim_demand.input_tokens, sim_demand.output_tokens, slo_ms=SLO_P99_MS)
    cold = ColdStart("measured", float(np.median(cold_starts_s)), max(cold_starts_s))
    policy = ModelplanePolicy("horizontal", target_concurrency=TARGET_CONCURRENCY, sweep_concurrency=SWEEP_LEVELS,
                              slo_p99_ms=SLO_P99_MS, min_replicas=MIN_REPLICAS, max_replicas=MAX_REPLICAS,
                              initial_replicas=1, config=ControllerConfig(scale_down_window_s=timing.lookback_s))
    run = simulate(sim_demand, model, policy, FleetConfig(initial_replicas=1, cold_start=cold, seed=timing.seed))
    return run, policy


# ---- both, and the JSON ------------------------------------------------------------------------

def by_phase(latencies: np.ndarray, weights: np.ndarray, arrived_s: np.ndarray, timing: Timing) -> dict:
    figures = {"all": percentiles(latencies, weights)}
    for name, (low, high) in phases(timing).items():
        inside = (arrived_s >= low) & (arrived_s < high)
        figures[name] = percentiles(latencies[inside], weights[inside])
    return figures


def notes(timing: Timing, quick: bool) -> list[str]:
    found = [
        "NOT the tiny LLM (not done): on 2 cores every vLLM replica of demo.tiny_llama computes on the same two "
        "cores (vllm_runtime.bind_cpus binds every replica to the first allowed cores), so scaling out adds no "
        "capacity and the comparison would measure CPU contention, not the "
        "simulator's independent replicas; each vLLM start-up also takes 30-50 s of both cores, and the harness "
        "deploys pyfunc revisions only. It needs a machine with cores (or an accelerator) per replica",
        f"replicas serve demo.service_time_model at {SERVICE_TIME_MS:g} ms a row (1 worker, max_batch_size 1); "
        "request sizes are rows from the trace's ContextTokens (see demand)",
        "the cost model is fitted per level as latency = alpha·rows + gamma (beta = 0), on one replica behind the "
        "real router, closed loops at concurrency 1, 2, 4",
        f"scale_down_window_s {timing.lookback_s:g} s (not 300 s) in both the real controller and the simulated one, "
        "so the scale-down falls inside the run",
        "the simulator counts waits in whole 1 s ticks; the real requests are sent at uniform random times within "
        "each second",
        "cold start = order → ready of the calibration and the measured endpoints' first replicas (2 samples); "
        "the simulator draws from a lognormal with their median and max as p90",
        "the router, controller, supervisor and load generator share one Python process and 2 cores",
    ]
    if quick:
        found.append(f"--quick: {timing.duration_s} s of demand, {timing.sweep_s:g} s per sweep level; one run")
    return found


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.machine import write_result

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 min of demand, short sweep")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--trace", default=str(TRACE_CSV), help="Azure LLM trace CSV")
    args = parser.parse_args(argv)
    timing = QUICK if args.quick else FULL
    started = time.monotonic()
    demand = fidelity_demand(read_trace(args.trace), timing)
    log(f"demand: {int(demand.arrivals.sum())} requests over {timing.duration_s} s, peak {demand.arrivals.max()} "
        f"per second")
    real = run_real(timing, demand)
    cost = rows_cost_model(real["samples"], real["points"], SLO_P99_MS)
    run, policy = run_sim(demand, cost, real["cold_starts_s"], timing)
    changes = [(t, int(n)) for t, n in enumerate(run.desired) if t == 0 or run.desired[t - 1] != n]
    sim_lat, sim_w, sim_arrived = sim_latencies(run.chunks, run.concurrency, cost, demand.rows)
    ok = [(at, ms) for at, ms, status in real["answers"] if status == 200]
    real_lat = np.array([ms for _, ms in ok])
    real_arrived = np.array([at for at, _ in ok])
    measured = {"latency": by_phase(real_lat, np.ones(len(real_lat)), real_arrived, timing),
                "ready": real["ready"], "total": real["total"]}
    predicted = {"latency": by_phase(sim_lat, sim_w, sim_arrived.astype(float), timing),
                 "ready": run.ready, "total": run.ready + run.starting}
    comparison = compare(measured, predicted)
    ratio, meets, why = verdict(comparison)
    failed = sum(1 for *_, status in real["answers"] if status != 200)
    ours = {"what": "the simulator's prediction (autoscale.sim.fleet.simulate with ModelplanePolicy('horizontal'))",
            "latency": predicted["latency"], "ready_per_s": run.ready.astype(int).tolist(),
            "ready_or_starting_per_s": (run.ready + run.starting).astype(int).tolist(),
            "rejected": int(run.rejected.sum()), "queued_at_end": run.queued_at_end,
            "max_throughput_rps_per_replica": round(run.model.max_throughput_rps, 2),
            "cold_start": {"median_s": round(run.cold_start.median_s, 2), "p90_s": round(run.cold_start.p90_s, 2)},
            "cost_model": cost.to_json(), "comparison": comparison,
            "decisions": [f"+{t} s ordered {n}" for t, n in changes[1:]]}
    anchor = {"what": "real local replicas: supervisor, router and controller (benchmarks.autoscale_harness)",
              "latency": measured["latency"], "ready_per_s": measured["ready"].tolist(),
              "ready_or_starting_per_s": measured["total"].tolist(), "failed": failed,
              "requests_sent": len(real["answers"]), "cold_starts_s": [round(s, 2) for s in real["cold_starts_s"]],
              "send_lateness_ms": real["send_lateness_ms"], "drain_after_end_s": real["drain_after_end_s"],
              "decisions": real["decisions"],
              "sweep": [p.to_json() for p in real["points"]]}
    settings = {**asdict(timing), "quick": args.quick, "service_time_ms": SERVICE_TIME_MS, "max_rows": MAX_ROWS,
                "sweep_levels": list(SWEEP_LEVELS), "slo_p99_ms": SLO_P99_MS, "min_replicas": MIN_REPLICAS,
                "max_replicas": MAX_REPLICAS, "target_concurrency": TARGET_CONCURRENCY,
                "demand": demand.description, "requests": int(demand.arrivals.sum()),
                "run_s": round(time.monotonic() - started, 1)}
    ours["settings"], ours["notes"] = settings, notes(timing, args.quick)
    ours["p50_ratio"] = comparison["latency_ratio_predicted_over_measured"]["all"]["p50"]
    ours["replica_difference"] = comparison["ready_replicas"]
    return write_result(args.json, benchmark="sim_fidelity", ours=ours, anchor=anchor, ratio=ratio, goal=GOAL,
                        meets_goal=meets and failed == 0,
                        unmet_reason=why or (f"{failed} real requests failed" if failed else None))


if __name__ == "__main__":
    main()
