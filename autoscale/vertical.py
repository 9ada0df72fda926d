"""Vertical autoscaling: retune an endpoint's per-replica target from what its replicas show.

The horizontal policy divides in-flight work by a per-replica ``target``. That target starts
at the cost model's benchmarked concurrency and this policy retunes it, at most every
``interval_s`` (30 s), from the p99 latency against the SLO, the engine queue and the
CPU/GPU/KV-cache utilization:

- **cut** when p99 is above ``slo × (1 + latency_dead_band)`` (1.1 × SLO) or a replica is
  stressed (any utilization above ``utilization_high``, or more than ``queue_depth_high``
  requests queued inside the engine per replica): the target is multiplied by the smallest of
  ``slo / p99``, ``utilization_high / utilization`` and ``target / (target + queue_depth)``,
  but never below ``target × (1 - max_step_down)`` (half) in one cycle. Cut fast;
- **raise** when p99 is below ``slo × raise_below_slo_fraction`` (0.7 × SLO), nothing is
  stressed and at most ``raise_max_queue_fraction × queue_depth_high`` (0.5) requests are
  queued per replica (a raise near the queue's stress line would be cut back the next
  cycle: the target would oscillate): by ``max_step_up`` (10 %) per cycle. Raise slowly, and only where the replicas
  actually ran near their target (``raise_min_load_fraction``), since low latency at low load
  says nothing about a higher target;
- **dead band** in between: p99 in [0.7, 1.1] × SLO is where a well-tuned target sits;
- **over target**: while the replicas hold more than ``target × (1 + latency_dead_band)`` in
  flight, neither: slow answers then say the endpoint has too few replicas (the horizontal
  axis is adding them), not that the target is too high. Cutting on them kept the target low
  for many cycles after every burst (``autoscale.sim`` measured 23 % more replica-hours for
  the two axes with the predictive floor, on the same day).

The result always lies in ``[min_target, max_target]`` (``target_bounds``: the cost model's
sweep levels). Worked example: target 8, SLO 500 ms, p99 700 ms (1.4 × the SLO):
8 × 500 / 700 = 5.71, above the half-step floor of 4, so the target becomes 5.71.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class VerticalConfig:
    """One endpoint's vertical policy; targets are in flight per replica, latencies in ms."""

    initial_target: float
    min_target: float
    max_target: float
    slo_p99_ms: float
    interval_s: float = 30.0
    latency_dead_band: float = 0.1
    max_step_down: float = 0.5
    max_step_up: float = 0.1
    utilization_high: float = 0.9
    raise_below_slo_fraction: float = 0.7  # raise only while p99 is under 70 % of the SLO
    queue_depth_high: float = 1.0  # more queued inside the engine per replica than this is stress
    raise_max_queue_fraction: float = 0.5  # raise only with at most this × queue_depth_high queued (hysteresis)
    raise_min_load_fraction: float = 0.8  # raise only where replicas ran at ≥ 80 % of the target

    def __post_init__(self) -> None:
        if not 0 < self.min_target <= self.initial_target <= self.max_target:
            raise ValueError(f"need 0 < min_target ≤ initial_target ≤ max_target, got {self.min_target}, "
                             f"{self.initial_target}, {self.max_target} (see target_bounds)")
        if not (self.slo_p99_ms > 0 and self.interval_s > 0):
            raise ValueError(f"slo_p99_ms and interval_s must be > 0, got {self.slo_p99_ms}, {self.interval_s}")
        if not (0 < self.max_step_down < 1 and self.max_step_up > 0 and self.latency_dead_band >= 0):
            raise ValueError(f"need 0 < max_step_down < 1, max_step_up > 0, latency_dead_band ≥ 0, got "
                             f"{self.max_step_down}, {self.max_step_up}, {self.latency_dead_band}")
        if not 0 < self.raise_below_slo_fraction <= 1 + self.latency_dead_band:
            raise ValueError(f"raise_below_slo_fraction must be in (0, 1 + latency_dead_band], got "
                             f"{self.raise_below_slo_fraction}")


@dataclass(frozen=True)
class VerticalSignals:
    """One window (about ``interval_s``) of what the replicas showed.

    ``p99_latency_ms`` is None when no request completed; ``queue_depth`` the mean requests
    waiting inside each replica's engine; utilizations are 0..1 means per replica (None: not
    measured); ``in_flight_per_replica`` the mean requests in flight per ready replica (None:
    not measured, the raise is then not held back for low load).
    """

    p99_latency_ms: float | None
    queue_depth: float
    cpu_utilization: float | None
    gpu_utilization: float | None = None
    kv_cache_utilization: float | None = None
    requests: int = 0
    in_flight_per_replica: float | None = None


@dataclass(frozen=True)
class VerticalState:
    """The current target and when it last changed (changes are at least ``interval_s`` apart)."""

    target: float
    last_change_s: float | None = None


@dataclass(frozen=True)
class TargetDecision:
    """The per-replica target to use, the rule that chose it, why (with numbers), and the inputs."""

    target: float
    rule: str
    reason: str
    inputs: dict


def initial_vertical_state(config: VerticalConfig) -> VerticalState:
    """Start from the benchmarked target, free to change at once."""
    return VerticalState(target=config.initial_target)


def target_bounds(sweep_concurrencies: Sequence[int], target: float) -> tuple[float, float]:
    """``[min_target, max_target]`` from the concurrency levels the cost model swept.

    The smallest swept level (at least 1) to the largest: outside them nothing was measured.
    The bounds are widened to contain ``target`` so the starting point is always inside; an
    empty sweep allows only cuts, down to 1.

        >>> target_bounds([1, 2, 4, 8, 16], target=8)
        (1.0, 16.0)
        >>> target_bounds([4, 8], target=2), target_bounds([], target=6)
        ((2.0, 8.0), (1.0, 6.0))
    """
    levels = [float(c) for c in sweep_concurrencies] or [1.0, float(target)]
    low = min(max(min(levels), 1.0), float(target))
    return low, max(max(levels), float(target))


def held_target(target_concurrency: float, pinned: bool, sweep: tuple[int, ...], recorded: float | None) -> float:
    """The per-replica target the autoscaler holds: the spec's when pinned, else the newest
    vertical decision (or the benchmarked start) kept within the swept bounds, as the
    controller does when it loads a window (``modelplane status`` and the metrics show this).

    >>> held_target(8.0, False, (1, 2, 4, 8, 16), recorded=24.0)  # above the sweep: held at 16
    16.0
    >>> held_target(8.0, True, (1, 2, 4, 8, 16), recorded=3.0), held_target(6.0, False, (), None)
    (8.0, 6.0)
    """
    if pinned:
        return target_concurrency
    low, high = target_bounds(sweep, target_concurrency)
    start = recorded if recorded is not None else target_concurrency
    return min(max(start, low), high)


def _stress(signals: VerticalSignals, config: VerticalConfig, target: float) -> list[tuple[float, str]]:
    """(cut factor, description) for every sign of stress."""
    found = []
    for name, value in (("CPU", signals.cpu_utilization), ("GPU", signals.gpu_utilization),
                        ("KV-cache", signals.kv_cache_utilization)):
        if value is not None and value > config.utilization_high:
            found.append((config.utilization_high / value,
                          f"{name} utilization {value:.2f} > {config.utilization_high:g}"))
    if signals.queue_depth > config.queue_depth_high:
        found.append((target / (target + signals.queue_depth),
                      f"{signals.queue_depth:.1f} queued per replica > {config.queue_depth_high:g}"))
    return found


def tune(signals: VerticalSignals, config: VerticalConfig, state: VerticalState,
         now_s: float) -> tuple[TargetDecision, VerticalState]:
    """One retune of the per-replica target, and the state to hand to the next call.

    p99 at 1.4 × the SLO cuts 8 to 8 × 500 / 700 = 5.71; p99 at 0.5 × the SLO raises 8 by 10 %.

        >>> config = VerticalConfig(initial_target=8, min_target=1, max_target=16, slo_p99_ms=500)
        >>> cut, state = tune(VerticalSignals(700.0, 0.0, 0.5), config, initial_vertical_state(config), 0.0)
        >>> cut.rule, round(cut.target, 2), state.last_change_s
        ('cut', 5.71, 0.0)
        >>> raised, _ = tune(VerticalSignals(250.0, 0.0, 0.5), config, VerticalState(8.0), 0.0)
        >>> raised.rule, round(raised.target, 2)
        ('raise', 8.8)
    """
    current, slo = state.target, config.slo_p99_ms
    p99 = signals.p99_latency_ms
    inputs = {"now_s": now_s, "target_before": current, "slo_p99_ms": slo, "p99_latency_ms": p99,
              "queue_depth": signals.queue_depth, "cpu_utilization": signals.cpu_utilization,
              "gpu_utilization": signals.gpu_utilization, "kv_cache_utilization": signals.kv_cache_utilization,
              "requests": signals.requests, "in_flight_per_replica": signals.in_flight_per_replica}

    def keep(rule: str, reason: str) -> tuple[TargetDecision, VerticalState]:
        return TargetDecision(current, rule, reason, inputs), state

    def change(new: float, rule: str, reason: str) -> tuple[TargetDecision, VerticalState]:
        return TargetDecision(new, rule, reason, inputs), VerticalState(new, now_s)

    if not config.min_target <= current <= config.max_target:
        bounded = min(max(current, config.min_target), config.max_target)
        return change(bounded, "bound", f"target {current:g} is outside [{config.min_target:g}, "
                      f"{config.max_target:g}]: set to {bounded:g}")
    if state.last_change_s is not None and now_s - state.last_change_s < config.interval_s:
        return keep("hold", f"last change {now_s - state.last_change_s:.0f} s ago; the target changes at most "
                    f"every {config.interval_s:g} s, once the window shows the last change's effect")
    if p99 is None:
        return keep("hold", f"no request completed in the window: holding target {current:g}")
    load = signals.in_flight_per_replica
    if load is not None and load > current * (1 + config.latency_dead_band):
        # Replicas above their target: slow answers mean too few replicas, which the horizontal axis is
        # adding, not a target set too high. Cutting here would keep the target low long after the burst.
        return keep("over-target", f"replicas run {load:.1f} in flight, above target {current:g} × "
                    f"{1 + config.latency_dead_band:g}: latency and stress now say too few replicas, not too high "
                    f"a target; holding it")
    high_ms, low_ms = slo * (1 + config.latency_dead_band), slo * config.raise_below_slo_fraction
    stress = _stress(signals, config, current)
    if p99 > high_ms:
        stress.insert(0, (slo / p99, f"p99 {p99:.0f} ms > {high_ms:.0f} ms ({1 + config.latency_dead_band:g} × "
                                     f"SLO {slo:g} ms)"))
    if stress:
        factor, why = min(stress, key=lambda item: item[0])
        floor = current * (1 - config.max_step_down)
        new = min(max(current * factor, floor, config.min_target), config.max_target)
        step = f", limited to one step down ({floor:.2f})" if current * factor < floor else ""
        if new >= current:
            return keep("bound", f"{why} would cut target {current:g} × {factor:.2f}, but it is at min_target "
                        f"{config.min_target:g}")
        bound = f", held at min_target {config.min_target:g}" if new == config.min_target > floor else ""
        return change(new, "cut", f"{why}: target {current:.2f} × {factor:.2f} → {new:.2f}{step}{bound}")
    if p99 < low_ms:
        queue_limit = config.raise_max_queue_fraction * config.queue_depth_high
        if signals.queue_depth > queue_limit:  # hysteresis: near the queue's stress line a raise would be cut back
            return keep("hold", f"p99 {p99:.0f} ms < {low_ms:.0f} ms, but {signals.queue_depth:.1f} queued per "
                        f"replica is above {queue_limit:g}: a higher target would queue more")
        if load is not None and load < config.raise_min_load_fraction * current:
            return keep("hold", f"p99 {p99:.0f} ms < {low_ms:.0f} ms, but replicas ran {load:.1f} in flight, under "
                        f"{config.raise_min_load_fraction:g} × target {current:g}: no evidence for a higher target")
        new = min(current * (1 + config.max_step_up), config.max_target)
        if new <= current:
            return keep("bound", f"p99 {p99:.0f} ms < {low_ms:.0f} ms, but target {current:g} is at max_target "
                        f"{config.max_target:g}")
        return change(new, "raise", f"p99 {p99:.0f} ms < {low_ms:.0f} ms ({config.raise_below_slo_fraction:g} × "
                      f"SLO) with nothing stressed: target {current:.2f} → {new:.2f} (at most "
                      f"+{config.max_step_up:.0%} a cycle)")
    return keep("dead-band", f"p99 {p99:.0f} ms within [{low_ms:.0f}, {high_ms:.0f}] ms and nothing stressed: "
                f"holding target {current:g}")
