"""Minutes of routing at 64 to 512 replicas, one request at a time: the router's own balancers
(``serving.router.balancing``, called as the router calls them) against a discrete-event
model of LLM replicas.

**Replicas.** A request of ``i`` input and ``o`` output tokens has a service demand of
``α·i + β·o + γ`` ms: its latency alone on an unslowed replica (concurrency 1). A replica
serves all its requests at once, processor sharing with a batching gain: holding ``n``, it
advances each at ``speed · g(n) / n`` demand-ms per ms, with

    g(n) = n / (1 + (n − 1)·k)        (g(1) = 1, concave, saturating at 1/k)

so each request runs ``1 + (n − 1)·k`` times slower than alone while the replica's
throughput grows ``g(n)``-fold. Default k = 0.05: g(8) = 5.9, g(32) = 12.5, at most 20 —
a decode step that slows as the batch grows. k = 0 with ``max_batch = c`` is the c-slot
FIFO replica of ``benchmarks.balance_quality``; k = 1 is one shared server. With
``max_batch`` set, requests beyond it wait at the replica, first come first served.
Replica 0 runs ``slow_factor`` times slower (speed 1/3 by default).

**Router.** The snapshot's dicts are live, as in ``serving.router.proxy``: a request's
model units and one request are added to its replica at dispatch (queued there or not) and
removed at completion. Its units are its latency at the target concurrency c over c,
``demand · (c / g(c)) / c = demand / g(c)``: the cost model fitted at c prices it exactly
(the best case; ``router_knows_output=False`` prices every output at the sizes' mean, as a
router without ``max_tokens`` does).

**Load.** Poisson arrivals at ``load_factor × replicas × g(c) / mean demand``: 1.0 is every
replica running c requests on average, c being the autoscaler's target; the mean demand is
over the whole size population passed in (the same rate for every seed), the capacity is
the unslowed fleet's. Sizes are drawn from it with replacement. Arrivals go on after
``duration_s`` until every measured request has finished (or ``drain_s`` more seconds, then
the unfinished count as their age: a lower bound, reported). Measured: the requests arriving
in ``[warmup_fraction · duration_s, duration_s)``.

**Cost.** Each arrival and completion is O(log n): per replica, a virtual clock counts the
demand-ms every running request has received, a request's finish tag is that clock at its
start plus its demand, and only the replica's smallest tag is scheduled in one global heap
(a stale entry is skipped by its version). The balancer call dominates: ``least_loaded``
scores every replica per request.

    .venv/bin/python -m autoscale.sim.routing [--quick] [--replicas 64 128 256 512] [--json OUT]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from autoscale.sim.workload import DRAIN_S, TRACE, ReplicaModel, Sizes, Workload, make_workload, read_sizes
from serving.router.balancing import BALANCERS, Snapshot, make_balancer

DEFAULT_DURATION_S = 120.0
QUICK_DURATION_S = 20.0
_NOTHING_EJECTED: frozenset[str] = frozenset()


@dataclass(frozen=True, eq=False)
class RunRecord:
    """What happened to each request of a workload under one balancer."""

    balancer: str
    slow_factor: float
    replica_of: np.ndarray  # per request: the replica it went to, -1 if it never arrived before the end
    finish_ms: np.ndarray  # per request: completion time, NaN if none
    end_ms: float  # when the simulation stopped
    in_flight_at_end: int  # the router's count, summed over replicas
    imbalance: np.ndarray  # each second of the measured window: max over mean in-flight requests per replica

    @property
    def dispatched(self) -> int:
        return int((self.replica_of >= 0).sum())

    @property
    def completed(self) -> int:
        return int(np.isfinite(self.finish_ms).sum())


def simulate(workload: Workload, balancer: str, slow_factor: float = 3.0, seed: int = 0,
             router_knows_output: bool = True, sample_every_s: float = 1.0) -> RunRecord:
    """Route ``workload`` with a fresh ``make_balancer(balancer)``; replica 0 is ``slow_factor``× slower.

    Two requests of 100 ms demand at once on one replica with k = 0.5: each runs at g(2)/2 = 2/3
    and both finish at 150 ms.

    >>> w = Workload(1, ReplicaModel(0, 0, 100.0, batching_k=0.5), np.array([0.0, 0.0]), np.zeros(2), np.zeros(2),
    ...              0.0, 1.0, 1000.0, 1.0, 1.0, 1.0)
    >>> simulate(w, "p2c_units", slow_factor=1.0).finish_ms.tolist()
    [150.0, 150.0]
    """
    if slow_factor < 1:
        raise ValueError(f"slow_factor must be ≥ 1 (1: no replica slowed), got {slow_factor}")
    model, replicas = workload.model, workload.replicas
    picker, rng = make_balancer(balancer), random.Random(seed)
    urls = [f"http://replica-{r:03d}:8000" for r in range(replicas)]
    index = {url: r for r, url in enumerate(urls)}
    units: dict[str, float] = defaultdict(float)  # live, as the router's in_flight and in_flight_requests
    requests: dict[str, int] = defaultdict(int)
    arrivals = workload.arrival_ms.tolist()
    demand = model.demand_ms(workload.input_tokens, workload.output_tokens).tolist()
    priced_output = workload.output_tokens if router_knows_output else workload.mean_output_tokens
    cost = np.maximum(model.units(workload.input_tokens, priced_output), 1e-3).tolist()  # RouteCost's floor
    n_requests = len(arrivals)
    replica_of, finish = [-1] * n_requests, [math.nan] * n_requests

    speed = [1.0] * replicas
    speed[0] = 1.0 / slow_factor
    k, max_batch = model.batching_k, model.max_batch or n_requests + 1
    running, clock_ms, attained, version = [0] * replicas, [0.0] * replicas, [0.0] * replicas, [0] * replicas
    tags: list[list[tuple[float, int]]] = [[] for _ in range(replicas)]  # (finish tag, request), running
    queued: list[deque[int]] = [deque() for _ in range(replicas)]
    events: list[tuple[float, int, int]] = []  # (time, replica, version): each replica's next completion

    def advance(r: int, now: float) -> None:
        if running[r]:
            attained[r] += (now - clock_ms[r]) * speed[r] / (1.0 + (running[r] - 1) * k)
        clock_ms[r] = now

    def start(r: int, j: int) -> None:
        heapq.heappush(tags[r], (attained[r] + demand[j], j))
        running[r] += 1

    def reschedule(r: int, now: float) -> None:
        version[r] += 1
        if tags[r]:
            left = tags[r][0][0] - attained[r]
            heapq.heappush(events, (now + max(left, 0.0) * (1.0 + (running[r] - 1) * k) / speed[r], r, version[r]))

    first_unmeasured = int(np.searchsorted(workload.arrival_ms, workload.measure_until_ms))
    measured_from = int(np.searchsorted(workload.arrival_ms, workload.measure_from_ms))
    pending, in_flight, samples = first_unmeasured - measured_from, 0, []
    sample_ms, sample_step_ms = workload.measure_from_ms, sample_every_s * 1000.0
    i, now, horizon = 0, 0.0, workload.horizon_ms
    while pending or i < first_unmeasured:
        next_arrival = arrivals[i] if i < n_requests else math.inf
        next_completion = events[0][0] if events else math.inf
        now = min(next_arrival, next_completion)
        if now >= horizon:
            now = horizon
            break
        while sample_ms <= now and sample_ms < workload.measure_until_ms:
            if in_flight:
                samples.append(max(requests.values()) * replicas / in_flight)
            sample_ms += sample_step_ms
        if next_completion <= next_arrival:
            _, r, seen = heapq.heappop(events)
            if seen != version[r]:
                continue
            advance(r, now)
            tag, j = heapq.heappop(tags[r])
            running[r] -= 1
            attained[r] = tag if running[r] else 0.0  # exact tags, no drift; an idle replica restarts at 0
            if queued[r]:
                start(r, queued[r].popleft())
            reschedule(r, now)
            finish[j], url = now, urls[r]
            units[url] -= cost[j]  # as serving.router.proxy._untake
            if units[url] <= 1e-9:
                del units[url]
            requests[url] -= 1
            if requests[url] <= 0:
                del requests[url]
            in_flight -= 1
            pending -= measured_from <= j < first_unmeasured
        else:
            url = picker.pick(urls, Snapshot(units, requests, _NOTHING_EJECTED, cost[i]), rng)
            units[url] += cost[i]
            requests[url] += 1
            in_flight += 1
            r = replica_of[i] = index[url]
            advance(r, now)
            if running[r] < max_batch:
                start(r, i)
                reschedule(r, now)
            else:
                queued[r].append(i)
            i += 1
    return RunRecord(picker.name, slow_factor, np.array(replica_of), np.array(finish), now, sum(requests.values()),
                     np.array(samples))


@dataclass(frozen=True)
class RoutingResult:
    """One balancer on one workload, over its measured requests.

    ``requests_unfinished``: measured requests still in flight when the run stopped (their age
    counts as their latency, a lower bound). ``slow_share``: the measured requests sent to the
    slowed replica; ``slow_fair_share``: its part of the fleet's capacity, speed / Σ speeds.
    ``in_flight_max_over_mean``: max over replicas of in-flight requests over their mean,
    sampled each second, averaged over samples; ``…_peak``: the largest sample.
    ``demand_p99_ms``: the p99 of the measured requests' own demand, the floor for any balancer.
    """

    balancer: str
    replicas: int
    load_factor: float
    arrival_rate_rps: float
    requests_measured: int
    requests_unfinished: int
    p50_ms: float
    p99_ms: float
    p999_ms: float
    mean_ms: float
    demand_p99_ms: float
    slow_factor: float
    slow_share: float
    slow_fair_share: float
    in_flight_max_over_mean: float
    in_flight_max_over_mean_peak: float

    def to_json(self) -> dict:
        return {key: round(value, 4) if isinstance(value, float) else value for key, value in asdict(self).items()}


def summarize(workload: Workload, record: RunRecord) -> RoutingResult:
    """The latency percentiles, slow replica share and imbalance of the measured requests."""
    arrival = workload.arrival_ms
    measured = slice(int(np.searchsorted(arrival, workload.measure_from_ms)),
                     int(np.searchsorted(arrival, workload.measure_until_ms)))
    finish = record.finish_ms[measured]
    unfinished = ~np.isfinite(finish)
    latency_ms = np.where(unfinished, record.end_ms, finish) - arrival[measured]
    if not len(latency_ms):
        raise ValueError("no request arrived in the measured window; lengthen duration_s or raise the load")
    p50, p99, p999 = np.percentile(latency_ms, [50, 99, 99.9])
    demand = workload.model.demand_ms(workload.input_tokens[measured], workload.output_tokens[measured])
    imbalance = record.imbalance if len(record.imbalance) else np.array([math.nan])
    return RoutingResult(
        record.balancer, workload.replicas, workload.load_factor, workload.rate_rps, len(latency_ms),
        int(unfinished.sum()), float(p50), float(p99), float(p999), float(latency_ms.mean()),
        float(np.percentile(demand, 99)), record.slow_factor, float(np.mean(record.replica_of[measured] == 0)),
        1.0 / (1.0 + (workload.replicas - 1) * record.slow_factor), float(imbalance.mean()), float(imbalance.max()))


def compare(balancers: Sequence[str], replicas_list: Sequence[int], load_factor: float, duration_s: float, seed: int,
            sizes: Sizes, slow_factor: float = 3.0, model: ReplicaModel = ReplicaModel(),
            router_knows_output: bool = True, warmup_fraction: float = 0.1, drain_s: float = DRAIN_S,
            log=None) -> list[RoutingResult]:
    """Every balancer at every replica count, on one workload per replica count (same seed, same requests).

    ``log``, if given, is called with each result and the run's wall time in seconds.
    """
    results = []
    for replicas in replicas_list:
        workload = make_workload(replicas, load_factor, duration_s, seed, sizes, model, warmup_fraction, drain_s)
        for name in balancers:
            started = time.perf_counter()
            result = summarize(workload, simulate(workload, name, slow_factor, seed, router_knows_output))
            if log is not None:
                log(result, time.perf_counter() - started)
            results.append(result)
    return results


def main(argv: list[str] | None = None) -> list[RoutingResult]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--balancers", nargs="+", default=list(BALANCERS))
    parser.add_argument("--replicas", nargs="+", type=int, default=[64, 128, 256, 512])
    parser.add_argument("--load", type=float, default=0.8, help="offered load, fraction of capacity at c")
    parser.add_argument("--duration-s", type=float, default=DEFAULT_DURATION_S)
    parser.add_argument("--quick", action="store_true", help=f"duration {QUICK_DURATION_S:g} s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument("--batching-k", type=float, default=ReplicaModel.batching_k, help="g(n) = n / (1 + (n-1)k)")
    parser.add_argument("--target-concurrency", type=int, default=ReplicaModel.target_concurrency)
    parser.add_argument("--max-batch", type=int, default=None, help="running at most; the rest wait (default: all run)")
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    def log(r: RoutingResult, wall_s: float) -> None:
        print(f"{r.replicas:4d} {r.balancer:13s} {wall_s:5.1f} s wall {r.requests_measured:6d} requests  p50 "
              f"{r.p50_ms:6.0f}  p99 {r.p99_ms:6.0f}  p99.9 {r.p999_ms:6.0f} ms  slow share {r.slow_share:.4f} "
              f"(fair {r.slow_fair_share:.4f})  max/mean {r.in_flight_max_over_mean:.2f}  unfinished "
              f"{r.requests_unfinished}", flush=True)

    results = compare(args.balancers, args.replicas, args.load, QUICK_DURATION_S if args.quick else args.duration_s,
                      args.seed, read_sizes(args.trace), args.slow_factor, log=log, model=ReplicaModel(
                          batching_k=args.batching_k, target_concurrency=args.target_concurrency,
                          max_batch=args.max_batch))
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in results], indent=1))
    return results


if __name__ == "__main__":
    main()
