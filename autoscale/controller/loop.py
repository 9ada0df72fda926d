"""The autoscaler's control loop: gather signals, call the pure policies, apply and record.

Every ``sample_interval_s`` (1 s) the leader — the controller holding the ``autoscaler``
lease — reads the routers' in-flight work, appends one sample per serving endpoint, asks
:func:`autoscale.horizontal.decide` for a replica count and, every ``vertical_interval_s``,
:func:`autoscale.vertical.tune` for a new per-replica target. A changed count goes to
``Cluster.scale``; every change is a row in ``scaling_decisions`` with its rule and numbers.
A lower count names its victims (:func:`autoscale.victims.pick_victims`): the revision's
replicas with the least work in flight at the routers, starting ones (nothing in flight)
included, measured in the endpoint's scaling signal (requests, or model units).

Windows live in memory and start empty: a controller that starts, restarts or takes the
lease over begins with no history, and the horizontal policy never scales down until it
holds a full lookback (``history_since_s``). The vertical target is reloaded from the
newest recorded decision of the serving revision, so a restart does not undo tuning.

The predictive floor (:mod:`autoscale.forecast`) raises the horizontal decision ahead of a
ramp seen a day (or a week) before; its horizon is the revision's measured cold start. The
highest floor of the scale-down lookback is the one applied: a forecast that falls is left
after ``scale_down_window_s``, like a peak, not the next minute. The
history is the endpoint's peak in flight per wall-clock minute, stored as each minute ends,
so the controller's clock is wall time (``python -m autoscale.controller``).

What each endpoint is scaled on:

- ``scaling.signal: requests``: in-flight requests against ``target_concurrency``;
- ``model_units``: in-flight model units against ``target_concurrency`` × the units of the
  sweep's reference request (:func:`autoscale.units.unit_target`);
- ``auto`` (default): model units for an LLM whose revision has a cost profile, else requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from autoscale.clock import Clock
from autoscale.forecast import DemandHistory, apply_floor, predictive_floor
from autoscale.horizontal import HorizontalConfig, HorizontalSignals, HorizontalState, Sample, decide, initial_state
from autoscale.units import reference_request_units, unit_target
from autoscale.victims import pick_victims
from autoscale.vertical import (VerticalConfig, VerticalSignals, VerticalState, initial_vertical_state, target_bounds,
                                tune)

MINUTE_S = 60.0
DEMAND_DAYS = 8


@dataclass(frozen=True)
class EndpointLoad:
    """One endpoint's load summed over every router, now."""

    in_flight_requests: float = 0.0
    in_flight_units: float = 0.0
    waiting_requests: int = 0
    p99_latency_ms: float | None = None  # over the routers' window; None without finished requests
    requests: int = 0  # finished in that window
    errors: int = 0  # of which server errors (5xx)
    # Per serving revision: (worst p99, answers, server errors), so a new one is judged on its own answers.
    by_revision: Mapping[str, tuple[float | None, int, int]] = field(default_factory=dict, repr=False)
    # Per replica base URL (which replicas a scale-down names); left out of the repr, which logs print.
    in_flight_requests_by_url: Mapping[str, float] = field(default_factory=dict, repr=False)
    in_flight_units_by_url: Mapping[str, float] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class ReplicaStats:
    """What the serving revision's replicas report, averaged over them (None: not reported)."""

    queue_depth: float = 0.0
    cpu_utilization: float | None = None
    kv_cache_utilization: float | None = None


class LoadSource(Protocol):
    def read(self) -> Mapping[str, EndpointLoad]:
        """Every endpoint's load now, summed across the live routers."""


class ReplicaStatsSource(Protocol):
    def read(self, replica_urls: list[str], runtime: str) -> ReplicaStats:
        """The replicas' queue and utilization."""


@dataclass(frozen=True)
class EndpointPlan:
    """What the controller needs to know about one serving endpoint, read from the stores."""

    endpoint: str
    revision_id: str
    runtime: str
    desired_replicas: int
    min_replicas: int
    max_replicas: int
    target_concurrency: float
    target_pinned: bool  # the spec set scaling.target_concurrency: the vertical axis leaves it alone
    sweep_concurrency: tuple[int, ...]
    slo_p99_ms: float
    scale_to_zero_grace_s: float
    unit_cost_ms: tuple[float, float, float, int] | None  # α, β, γ, c of the cost profile: model-unit mode
    reference_tokens: tuple[float, float] = (64.0, 16.0)  # input, output tokens of the reference request
    recorded_target: float | None = None  # the newest vertical decision of this revision
    cold_start_s: float | None = None  # measured time to ready: the predictive floor's horizon


@dataclass(frozen=True)
class ReplicaCounts:
    ready: int
    starting: int
    urls: tuple[str, ...]  # the ready replicas' base URLs
    replica_ids_by_url: Mapping[str, str] = field(default_factory=dict)  # every replica: the victim candidates


class Recorder(Protocol):
    """Where decisions and per-minute demand are kept (``controlplane.scaling.ScalingStore``)."""

    def record(self, endpoint: str, revision_id: str, axis: str, *, rule: str, reason: str, inputs: dict,
               replicas: int | None = None, target: float | None = None) -> object: ...

    def save_demand(self, endpoint: str, minute: int, peak_in_flight: float) -> None: ...

    def demand(self, endpoint: str, since_minute: int) -> dict[int, float]: ...


@dataclass
class Window:
    """One endpoint's samples and policy states, for the revision that serves it."""

    revision_id: str
    horizontal: HorizontalState
    vertical: VerticalState
    samples: deque = field(default_factory=deque)
    vertical_checked_s: float | None = None  # replicas' stats are read this often, not every sample
    history: DemandHistory = field(default_factory=DemandHistory)  # per-minute peaks, for the predictive floor
    floors: deque = field(default_factory=deque)  # (at_s, floor, reason) of the lookback: a floor is held like a peak


@dataclass(frozen=True)
class ControllerConfig:
    sample_interval_s: float = 1.0
    scale_down_window_s: float = 300.0
    scale_up_window_s: float = 20.0
    scale_up_interval_s: float = 5.0
    vertical_interval_s: float = 30.0


def in_flight_by_replica(counts: ReplicaCounts, in_flight_by_url: Mapping[str, float]) -> dict[str, float]:
    """Each replica's work in flight, by replica id; 0 for one no router sends to (starting, unhealthy).

    >>> counts = ReplicaCounts(ready=2, starting=1, urls=("http://a", "http://b"),
    ...                        replica_ids_by_url={"http://a": "r-0", "http://b": "r-1", "http://c": "r-2"})
    >>> in_flight_by_replica(counts, {"http://a": 3.0, "http://b": 1.0, "http://old": 5.0})
    {'r-0': 3.0, 'r-1': 1.0, 'r-2': 0.0}
    """
    return {replica_id: float(in_flight_by_url.get(url, 0.0))
            for url, replica_id in counts.replica_ids_by_url.items()}


class Controller:
    """Gathers, decides, applies. ``tick`` is one pass; the process main calls it every second."""

    def __init__(self, *, plans: Callable[[], list[EndpointPlan]], replicas: Callable[[str], ReplicaCounts],
                 load: LoadSource, stats: ReplicaStatsSource, scale: Callable[[str, int, Sequence[str]], None],
                 recorder: Recorder, is_leader: Callable[[], bool], clock: Clock, config: ControllerConfig = ControllerConfig(),
                 log: Callable[[str], None] = print) -> None:
        self._plans, self._replicas, self._load, self._stats = plans, replicas, load, stats
        self._scale, self._recorder, self._is_leader, self._clock = scale, recorder, is_leader, clock
        self.config, self._log = config, log
        self.windows: dict[str, Window] = {}

    def tick(self) -> None:
        now_s = self._clock.now_s()
        if not self._is_leader():
            self.windows.clear()  # when it leads again, it starts with no history (and so no scale-down)
            return
        plans = self._plans()
        loads = self._load.read()
        for plan in plans:
            self._one(plan, loads.get(plan.endpoint, EndpointLoad()), now_s)
        for endpoint in set(self.windows) - {p.endpoint for p in plans}:
            del self.windows[endpoint]

    def _one(self, plan: EndpointPlan, load: EndpointLoad, now_s: float) -> None:
        window = self.windows.get(plan.endpoint)
        if window is None or window.revision_id != plan.revision_id:
            window = self.windows[plan.endpoint] = self._new_window(plan, now_s)
        units = plan.unit_cost_ms is not None
        in_flight = load.in_flight_units if units else load.in_flight_requests
        window.samples.append(Sample(now_s, in_flight))
        self._remember_demand(plan.endpoint, window, now_s, in_flight)
        while window.samples and window.samples[0].at_s < now_s - self.config.scale_down_window_s:
            window.samples.popleft()
        counts = self._replicas(plan.revision_id)
        self._vertical(plan, window, load, counts, now_s)
        per_replica = window.vertical.target
        if units:
            alpha, beta, gamma, concurrency = plan.unit_cost_ms
            per_replica = unit_target(window.vertical.target, reference_request_units(
                alpha, beta, gamma, concurrency, *plan.reference_tokens))
        config = HorizontalConfig(min_replicas=plan.min_replicas, max_replicas=plan.max_replicas, target=per_replica,
                                  scale_up_interval_s=self.config.scale_up_interval_s,
                                  scale_up_window_s=self.config.scale_up_window_s,
                                  scale_down_window_s=self.config.scale_down_window_s,
                                  scale_to_zero_grace_s=plan.scale_to_zero_grace_s)
        signals = HorizontalSignals(samples=tuple(window.samples), ready_replicas=counts.ready,
                                    starting_replicas=counts.starting, waiting_requests=load.waiting_requests)
        decision, window.horizontal = decide(signals, config, window.horizontal, now_s)
        if plan.cold_start_s is not None:  # look as far ahead as a new replica takes to become ready
            floor, why = predictive_floor(window.history, now_s, max(plan.cold_start_s, MINUTE_S), per_replica,
                                          plan.max_replicas)
            floor, why = self._held_floor(window, now_s, floor, why)
            floored = apply_floor(decision, floor, why)
            if floored.replicas != decision.replicas:
                decision = floored
                window.horizontal = replace(window.horizontal, desired=decision.replicas)
        if decision.replicas != plan.desired_replicas:
            in_flight_by_url = load.in_flight_units_by_url if units else load.in_flight_requests_by_url
            victims = pick_victims(in_flight_by_replica(counts, in_flight_by_url),
                                   plan.desired_replicas - decision.replicas)
            self._scale(plan.revision_id, decision.replicas, victims)
            inputs = {**decision.inputs, "signal": "model_units" if units else "requests", "target": per_replica}
            if victims:
                inputs["victims"] = victims
            self._recorder.record(plan.endpoint, plan.revision_id, "horizontal", replicas=decision.replicas,
                                  rule=decision.rule, reason=decision.reason, inputs=inputs)
            self._log(f"{plan.endpoint}: {plan.desired_replicas} → {decision.replicas} replicas ({decision.reason})")

    def _held_floor(self, window: Window, now_s: float, floor: int, why: str) -> tuple[int, str]:
        """The highest floor of the scale-down lookback: a forecast that falls is left the way a peak
        is, after ``scale_down_window_s``, not the next minute (yesterday's minutes would otherwise
        move the count up and down by a replica a minute)."""
        window.floors.append((now_s, floor, why))
        while window.floors and window.floors[0][0] <= now_s - self.config.scale_down_window_s:
            window.floors.popleft()
        at_s, held, reason = max(window.floors, key=lambda item: (item[1], item[0]))
        if held <= floor:
            return floor, why
        return held, (f"{reason} ({now_s - at_s:.0f} s ago; a forecast is held for the "
                      f"{self.config.scale_down_window_s:g} s lookback)")

    def _new_window(self, plan: EndpointPlan, now_s: float) -> Window:
        config = self._vertical_config(plan)
        vertical = initial_vertical_state(config)
        if plan.recorded_target is not None and not plan.target_pinned:
            vertical = VerticalState(target=min(max(plan.recorded_target, config.min_target), config.max_target))
        window = Window(plan.revision_id, initial_state(plan.desired_replicas, now_s), vertical)
        since = int(now_s // MINUTE_S) - DEMAND_DAYS * 24 * 60
        for minute, peak in self._recorder.demand(plan.endpoint, since).items():  # the endpoint's, not the revision's
            window.history.add(minute * MINUTE_S, peak)
        return window

    def _remember_demand(self, endpoint: str, window: Window, now_s: float, in_flight: float) -> None:
        """Keep this minute's peak; when a minute ends, store it (a restarted controller reloads it)."""
        minute = int(now_s // MINUTE_S)
        last = next(reversed(window.history.peak_by_minute), None)
        window.history.add(now_s, in_flight)
        if last is not None and last < minute:
            self._recorder.save_demand(endpoint, last, window.history.peak_by_minute[last])

    def _vertical_config(self, plan: EndpointPlan) -> VerticalConfig:
        if plan.target_pinned:
            low = high = plan.target_concurrency
        else:
            low, high = target_bounds(plan.sweep_concurrency, plan.target_concurrency)
        return VerticalConfig(initial_target=min(max(plan.target_concurrency, low), high), min_target=low,
                              max_target=high, slo_p99_ms=plan.slo_p99_ms,
                              interval_s=self.config.vertical_interval_s)

    def _vertical(self, plan: EndpointPlan, window: Window, load: EndpointLoad, counts: ReplicaCounts,
                  now_s: float) -> None:
        if plan.target_pinned or not counts.urls:
            return
        config = self._vertical_config(plan)
        if window.vertical_checked_s is not None and now_s - window.vertical_checked_s < config.interval_s:
            return
        window.vertical_checked_s = now_s
        stats = self._stats.read(list(counts.urls), plan.runtime)
        signals = VerticalSignals(p99_latency_ms=load.p99_latency_ms, queue_depth=stats.queue_depth,
                                  cpu_utilization=stats.cpu_utilization,
                                  kv_cache_utilization=stats.kv_cache_utilization, requests=load.requests,
                                  in_flight_per_replica=load.in_flight_requests / len(counts.urls))
        before = window.vertical.target
        decision, window.vertical = tune(signals, config, window.vertical, now_s)
        if decision.target != before:
            self._recorder.record(plan.endpoint, plan.revision_id, "vertical", target=decision.target,
                                  rule=decision.rule, reason=decision.reason, inputs=decision.inputs)
            self._log(f"{plan.endpoint}: target {before:g} → {decision.target:g} ({decision.reason})")
