"""The tick-level fleet model: a day of demand against a replica-count policy, one tick a second.

Per tick, in this order (no Python object per request: the queue holds one entry per tick
of arrivals, ``[arrival tick, count]``):

1. replicas whose cold start has ended become ready;
2. the tick's arrivals join the FIFO queue;
3. requests that have waited more than ``max_queue_wait_s`` are **rejected** (the router's
   503 after ``routing.max_queue_wait_s``, 10 s by default);
4. the ready replicas serve up to their capacity, ``ready × max_throughput`` requests a
   second, from the head of the queue; what they cannot take stays **queued**;
5. the served requests set the concurrency each replica runs at, by Little's law
   (``ReplicaModel.concurrency_for``); their latency is their wait plus their service latency
   at that concurrency, and each tick's share within the SLO is read from the whole size
   distribution after the run (``ReplicaModel.share_within``);
6. the policy sees the fleet (:class:`~autoscale.sim.view.FleetView`: in flight = running +
   queued) and orders a count; more starts replicas (each with its own cold-start draw), less
   cancels starting ones first (the newest), then removes ready ones.

Replica-seconds count ready and starting replicas (both hold a GPU). Every arrival ends the
run served, rejected or still queued, counted once (``FleetRun.conservation_error``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from autoscale.sim.demand import Demand
from autoscale.sim.replica import ColdStart, ReplicaModel
from autoscale.sim.view import FleetView, ScalingPolicy


@dataclass(frozen=True)
class FleetConfig:
    initial_replicas: int
    cold_start: ColdStart
    max_queue_wait_s: float = 10.0
    seed: int = 0


@dataclass
class FleetRun:
    """Per-tick series of one run (numpy arrays) and the served chunks; figures in ``autoscale.sim.report``."""

    policy: str
    demand: Demand
    model: ReplicaModel
    ready: np.ndarray
    starting: np.ndarray
    desired: np.ndarray
    in_flight: np.ndarray
    queued: np.ndarray
    served: np.ndarray
    rejected: np.ndarray
    concurrency: np.ndarray  # per ready replica, of the served requests
    chunks: np.ndarray  # rows (arrival tick, served tick, count)
    queued_at_end: int
    cold_start: ColdStart
    replica_seconds: float = field(init=False)

    def __post_init__(self) -> None:
        self.replica_seconds = float((self.ready + self.starting).sum()) * self.demand.tick_s

    @property
    def conservation_error(self) -> int:
        """arrivals − (served + rejected + queued at the end): 0 when every request is counted once."""
        return int(self.demand.arrivals.sum() - self.served.sum() - self.rejected.sum() - self.queued_at_end)


class _Replicas:
    """Ready count and the starting replicas' ready times (seconds), ordered by start."""

    def __init__(self, ready: int, cold_start: ColdStart, rng: np.random.Generator) -> None:
        self.ready = ready
        self.starting: deque[float] = deque()
        self._cold_start, self._rng = cold_start, rng

    def tick(self, now_s: float) -> None:
        if not self.starting:
            return
        still = deque(t for t in self.starting if t > now_s)
        self.ready += len(self.starting) - len(still)
        self.starting = still

    def order(self, desired: int, now_s: float) -> None:
        current = self.ready + len(self.starting)
        if desired > current:
            self.starting.extend(now_s + self._cold_start.draw_s(self._rng, desired - current))
        elif desired < current:
            cut = current - desired
            while cut and self.starting:
                self.starting.pop()
                cut -= 1
            self.ready -= cut


def simulate(demand: Demand, model: ReplicaModel, policy: ScalingPolicy, config: FleetConfig) -> FleetRun:
    """Run ``policy`` over every tick of ``demand``; see the module docstring for the model."""
    rng = np.random.default_rng(config.seed)
    replicas = _Replicas(config.initial_replicas, config.cold_start, rng)
    ticks, tick_s = demand.ticks, demand.tick_s
    arrivals = demand.arrivals.tolist()
    series = {name: [0.0] * ticks for name in ("ready", "starting", "desired", "in_flight", "queued", "served",
                                                "rejected", "concurrency")}
    queue: deque[list[int]] = deque()
    queued_total = 0
    chunks: list[tuple[int, int, int]] = []
    max_wait_ticks = config.max_queue_wait_s / tick_s
    per_replica_capacity = model.max_throughput_rps * tick_s
    desired = config.initial_replicas
    for t in range(ticks):
        now_s = t * tick_s
        replicas.tick(now_s)
        if arrivals[t]:
            queue.append([t, arrivals[t]])
            queued_total += arrivals[t]
        rejected = 0
        while queue and t - queue[0][0] > max_wait_ticks:
            rejected += queue.popleft()[1]
        queued_total -= rejected
        capacity = int(replicas.ready * per_replica_capacity)
        served, first_chunk = 0, len(chunks)
        while queue and served < capacity:
            head = queue[0]
            take = min(head[1], capacity - served)
            chunks.append((head[0], t, take))
            served += take
            head[1] -= take
            if head[1] == 0:
                queue.popleft()
        queued_total -= served
        n = model.concurrency_for(served / (replicas.ready * tick_s)) if replicas.ready else 0.0
        running = n * replicas.ready
        p99 = model.p99_ms(n) + _p99_wait_s(chunks, first_chunk, served) * 1000.0 * tick_s if served else None
        view = FleetView(now_s=now_s, in_flight=running + queued_total, running=running, queued=float(queued_total),
                         ready=replicas.ready, starting=len(replicas.starting), desired=desired,
                         arrivals_rps=arrivals[t] / tick_s, p99_latency_ms=p99,
                         utilization=n / model.knee if replicas.ready else 0.0)
        desired = max(int(policy.decide(view)), 0)
        replicas.order(desired, now_s)
        for name, value in (("ready", replicas.ready), ("starting", len(replicas.starting)), ("desired", desired),
                            ("in_flight", view.in_flight), ("queued", queued_total), ("served", served),
                            ("rejected", rejected), ("concurrency", n)):
            series[name][t] = value
    arrays = {name: np.array(values) for name, values in series.items()}
    return FleetRun(policy=policy.name, demand=demand, model=model, chunks=np.array(chunks, dtype=np.int64).reshape(-1, 3),
                    queued_at_end=queued_total, cold_start=config.cold_start, **arrays)


def _p99_wait_s(chunks: list[tuple[int, int, int]], first: int, served: int) -> float:
    """The wait (ticks) of the served request at the 99th percentile: the oldest chunks come first."""
    tail, seen = served * 0.01, 0
    for arrived, at, count in chunks[first:]:
        seen += count
        if seen > tail:
            return float(at - arrived)
    return 0.0


def within_slo(run: FleetRun) -> tuple[float, float]:
    """(requests served within the SLO, requests served past it): each served chunk's share from its
    wait and the concurrency of the tick that served it, over the whole size distribution."""
    if not len(run.chunks):
        return 0.0, 0.0
    arrival, served_at, count = run.chunks[:, 0], run.chunks[:, 1], run.chunks[:, 2].astype(float)
    wait_ms = (served_at - arrival) * run.demand.tick_s * 1000.0
    share = run.model.share_within(run.concurrency[served_at], run.model.slo_ms - wait_ms)
    within = float((share * count).sum())
    return within, float(count.sum()) - within


def ticks_to_capacity(run: FleetRun, from_tick: int, hold_ticks: int = 60) -> int | None:
    """Ticks from ``from_tick`` until the fleet serves every arrival within the SLO's p99 — nothing
    queued and the replicas at a concurrency whose p99 holds the SLO — and keeps doing so for
    ``hold_ticks`` ticks; None if that never happens. Independent of any policy's target."""
    enough = (run.queued == 0) & (run.concurrency <= run.model.concurrency_at_slo_p99())
    streak = 0
    for t in range(from_tick, run.demand.ticks):
        streak = streak + 1 if enough[t] else 0
        if streak >= hold_ticks:
            return t - hold_ticks + 1 - from_tick
    return None


def replicas_for_rate(rps: float, rps_per_replica: float) -> int:
    """Replicas that carry ``rps`` at ``rps_per_replica`` each: 200,000 at 1,200 → 167."""
    return max(math.ceil(rps / rps_per_replica - 1e-9), 0)
