"""modelplane's own autoscaler in the simulator: the controller's ``Controller`` itself, with fakes around it.

Not a re-implementation: :class:`ModelplanePolicy` builds an
``autoscale.controller.loop.Controller`` (the class ``python -m autoscale.controller`` runs)
and hands it fakes for what it reads and writes — the plan of one endpoint, the replica
counts, the routers' load, the replicas' stats, ``scale`` and the decision recorder — and a
``FakeClock`` the simulator moves one tick at a time. Each tick is one ``Controller.tick``:
the same samples, the same ``horizontal.decide``, ``vertical.tune``, ``forecast``'s
predictive floor and ``apply_floor`` as in production.

Three modes, as a user would configure them:

- ``horizontal``: ``scaling.target_concurrency`` pinned (the vertical axis leaves it alone),
  no predictive floor;
- ``two_axes``: the target starts at the cost model's and the vertical axis retunes it
  (unless ``target_pinned``: a spec that sets ``scaling.target_concurrency`` pins it, as in
  production);
- ``two_axes_predictive``: also the predictive floor, with the cold start as its horizon and
  yesterday's demand in the recorder (``yesterday``: peak in flight per minute, minute indices
  −1440..−1, as the controller stores them).

The routers' p99 is the mean of the last 30 ticks' p99s, weighted by the requests running in
each (the day model keeps no per-request latencies).

The scaling signal is requests in flight (``scaling.signal: requests``): the day model holds
per-tick aggregates, where model units are requests × a constant mean and scale the same.
The replicas report their engine queue per replica; CPU/GPU utilization is not modelled
(``None``, as a replica that does not report it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from autoscale.clock import FakeClock
from autoscale.controller.loop import (Controller, ControllerConfig, EndpointLoad, EndpointPlan, ReplicaCounts,
                                       ReplicaStats)
from autoscale.sim.view import FleetView

MODES = ("horizontal", "two_axes", "two_axes_predictive")
ENDPOINT, REVISION = "sim", "sim-1"
P99_WINDOW_TICKS = 30  # the routers report p99 over their recent window


class _Recorder:
    def __init__(self, yesterday: Mapping[int, float]) -> None:
        self.yesterday = dict(yesterday)
        self.saved: dict[int, float] = {}
        self.decisions: list[tuple[str, str, float | None]] = []  # (axis, rule, replicas or target)

    def record(self, endpoint: str, revision_id: str, axis: str, *, rule: str, reason: str, inputs: dict,
               replicas: int | None = None, target: float | None = None) -> None:
        self.decisions.append((axis, rule, replicas if axis == "horizontal" else target))

    def save_demand(self, endpoint: str, minute: int, peak_in_flight: float) -> None:
        self.saved[minute] = peak_in_flight

    def demand(self, endpoint: str, since_minute: int) -> dict[int, float]:
        return {m: p for m, p in {**self.yesterday, **self.saved}.items() if m >= since_minute}


class _Source:
    """The routers' load and the replicas' stats, set from the fleet each tick."""

    def __init__(self) -> None:
        self.load = EndpointLoad()
        self.stats = ReplicaStats()

    def read(self, *args) -> Mapping[str, EndpointLoad] | ReplicaStats:
        return self.stats if args else {ENDPOINT: self.load}


class _Stats:
    def __init__(self, source: _Source) -> None:
        self._source = source

    def read(self, replica_urls: list[str], runtime: str) -> ReplicaStats:
        return self._source.stats


class ModelplanePolicy:
    """``decide(view)`` = one ``Controller.tick`` at ``view.now_s``; returns the count it ordered."""

    def __init__(self, mode: str, *, target_concurrency: float, sweep_concurrency: Sequence[int], slo_p99_ms: float,
                 min_replicas: int, max_replicas: int, initial_replicas: int, cold_start_s: float | None = None,
                 target_pinned: bool = False, scale_to_zero_grace_s: float = 300.0,
                 yesterday: Mapping[int, float] | None = None, config: ControllerConfig = ControllerConfig()) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown modelplane mode {mode!r}; known: {', '.join(MODES)}")
        if mode == "two_axes_predictive" and (cold_start_s is None or not yesterday):
            raise ValueError("the predictive floor needs the cold start (its horizon) and yesterday's demand")
        self.name = f"modelplane_{mode}"
        self.desired = initial_replicas
        self._plan = EndpointPlan(
            endpoint=ENDPOINT, revision_id=REVISION, runtime="sim", desired_replicas=initial_replicas,
            min_replicas=min_replicas, max_replicas=max_replicas, target_concurrency=float(target_concurrency),
            target_pinned=mode == "horizontal" or target_pinned, sweep_concurrency=tuple(sweep_concurrency),
            slo_p99_ms=slo_p99_ms, scale_to_zero_grace_s=scale_to_zero_grace_s, unit_cost_ms=None,
            cold_start_s=cold_start_s if mode == "two_axes_predictive" else None)
        self._counts = ReplicaCounts(0, 0, ())
        self._urls: tuple[str, ...] = ()
        self._source = _Source()
        self.recorder = _Recorder(yesterday or {})
        self.clock = FakeClock()
        self._p99: list[tuple[float, float]] = []  # (requests, p99) of the last ticks
        self.controller = Controller(plans=self._plans, replicas=self._replicas, load=self._source,
                                     stats=_Stats(self._source), scale=self._scale, recorder=self.recorder,
                                     is_leader=lambda: True, clock=self.clock, config=config, log=lambda line: None)

    def _plans(self) -> list[EndpointPlan]:
        if self._plan.desired_replicas != self.desired:
            self._plan = replace(self._plan, desired_replicas=self.desired)
        return [self._plan]

    def _replicas(self, revision_id: str) -> ReplicaCounts:
        return self._counts

    def _scale(self, revision_id: str, replicas: int, victims: Sequence[str]) -> None:
        self.desired = replicas

    @property
    def target(self) -> float:
        """The per-replica target the vertical axis holds now."""
        window = self.controller.windows.get(ENDPOINT)
        return window.vertical.target if window else self._plan.target_concurrency

    def decide(self, view: FleetView) -> int:
        self.clock.advance(view.now_s - self.clock.now_s())
        if len(self._urls) != view.ready:
            self._urls = tuple(f"replica-{k}" for k in range(view.ready))
        self._counts = ReplicaCounts(view.ready, view.starting, self._urls)
        if view.p99_latency_ms is not None:  # weighted by the requests running, a proxy for those answered
            self._p99.append((view.running, view.p99_latency_ms))
        del self._p99[:-P99_WINDOW_TICKS]
        weight = sum(w for w, _ in self._p99)
        p99 = sum(w * p for w, p in self._p99) / weight if weight > 0 else None
        self._source.load = EndpointLoad(in_flight_requests=view.in_flight, p99_latency_ms=p99,
                                         waiting_requests=0 if view.ready else int(view.queued),
                                         requests=int(view.arrivals_rps))  # recorded in decisions only
        self._source.stats = ReplicaStats(queue_depth=view.queued / view.ready if view.ready else 0.0)
        self.controller.tick()
        return self.desired
