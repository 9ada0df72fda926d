"""Horizontal autoscaling: how many replicas an endpoint wants.

    desired = ceil(in_flight / target)

where ``in_flight`` is the work the routers hold for the endpoint (requests, or model units
in model-unit mode) and ``target`` the work one replica should hold. With 37 requests in
flight and a target of 4: ceil(37 / 4) = 10 replicas.

Up is fast, down is slow (the asymmetry of Knative's panic mode and HPA's stabilization):

- scale-up is decided at most every ``scale_up_interval_s`` (5 s) from the *maximum* in
  flight of the last ``scale_up_window_s`` (20 s), and one decision grows the endpoint to at
  most ``max(capacity + growth_allowance_replicas, max_growth_factor × capacity)``, like HPA's
  default scale-up policies (+4 pods or +100 %, whichever is more);
- replicas that are still loading count as capacity: the policy never orders more because an
  earlier order has not finished starting;
- scale-down uses the maximum of the last ``scale_down_window_s`` (300 s), never before the
  controller holds that much history (a restarted controller does not scale down because it
  has not seen the last five minutes), and, while replicas are loading, only cancels the
  orders the lookback no longer justifies: no ready replica is stopped before the new ones
  serve. (Holding every reduction while anything loads, as before, kept a fleet with
  minutes-long cold starts at its burst peak for most of the day: ``autoscale.sim`` measured
  31 % more replica-hours for the same requests within the SLO.)
- with ``min_replicas == 0``, no traffic for ``scale_to_zero_grace_s`` goes to zero, and a
  request waiting for an endpoint with no replica orders one at once.

The result always lies in ``[min_replicas, max_replicas]``. Each ``Decision`` names the rule
that made it, a sentence with its numbers, and the inputs it used.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

_EPSILON = 1e-9  # 8.000000001 in flight at target 4 is 2 replicas, not 3


@dataclass(frozen=True)
class HorizontalConfig:
    """One endpoint's horizontal policy; ``target`` is in flight per replica (requests or model units)."""

    min_replicas: int
    max_replicas: int
    target: float
    scale_up_interval_s: float = 5.0
    scale_up_window_s: float = 20.0
    scale_down_window_s: float = 300.0
    max_growth_factor: float = 2.0
    scale_to_zero_grace_s: float = 300.0
    growth_allowance_replicas: int = 4  # one cycle may always add this many, even where factor × capacity is less

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(self.min_replicas, 1):
            raise ValueError(f"need 0 ≤ min_replicas ≤ max_replicas and max_replicas ≥ 1, got min_replicas "
                             f"{self.min_replicas}, max_replicas {self.max_replicas}")
        if not self.target > 0:
            raise ValueError(f"target (in flight per replica) must be > 0, got {self.target}")
        for name in ("scale_up_interval_s", "scale_up_window_s", "scale_down_window_s", "scale_to_zero_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_growth_factor < 1 or self.growth_allowance_replicas < 1:
            raise ValueError(f"max_growth_factor must be ≥ 1 and growth_allowance_replicas ≥ 1, got "
                             f"{self.max_growth_factor} and {self.growth_allowance_replicas}")


@dataclass(frozen=True)
class Sample:
    """In-flight work summed over the routers at one instant (the unit of ``target``)."""

    at_s: float
    in_flight: float


@dataclass(frozen=True)
class HorizontalSignals:
    """What the controller observed: samples about 1 s apart over the last ``scale_down_window_s``.

    ``starting_replicas`` are ordered and still loading; ``waiting_requests`` are requests a
    router holds because the endpoint has no ready replica.
    """

    samples: tuple[Sample, ...]
    ready_replicas: int
    starting_replicas: int
    waiting_requests: int = 0


@dataclass(frozen=True)
class HorizontalState:
    """What the policy remembers between calls; the controller stores it and hands it back.

    ``history_since_s`` is when the controller's samples begin (for a restarted controller,
    its start); ``last_traffic_s`` the last time anything was in flight or waiting.
    """

    desired: int
    history_since_s: float
    last_scale_up_check_s: float | None = None
    last_traffic_s: float | None = None


@dataclass(frozen=True)
class Decision:
    """The replica count to converge to, the rule that chose it, why (with numbers), and the inputs."""

    replicas: int
    rule: str
    reason: str
    inputs: dict


def initial_state(desired: int, now_s: float) -> HorizontalState:
    """The state of a controller that starts (or restarts) at ``now_s`` with ``desired`` replicas ordered.

    ``desired`` is the count the cluster was last ordered (its stored spec), not zero: the
    policy holds it until it has the samples to decide otherwise.
    """
    return HorizontalState(desired=desired, history_since_s=now_s)


def replicas_for(in_flight: float, target: float) -> int:
    """``ceil(in_flight / target)``: 37 requests at 4 per replica need 10 replicas.

        >>> replicas_for(37.0, 4.0), replicas_for(8.0, 4.0), replicas_for(0.0, 4.0)
        (10, 2, 0)
    """
    return max(math.ceil(in_flight / target - _EPSILON), 0)


def growth_limit(capacity: int, config: HorizontalConfig) -> int:
    """The most replicas one scale-up may reach: ``max(capacity + allowance, ceil(factor × capacity))``.

    With the defaults (factor 2, allowance 4): 6 replicas may grow to 12, 1 replica to 5, and
    an endpoint at zero to 4.

        >>> config = HorizontalConfig(min_replicas=0, max_replicas=100, target=4)
        >>> growth_limit(6, config), growth_limit(1, config), growth_limit(0, config)
        (12, 5, 4)
    """
    return max(capacity + config.growth_allowance_replicas, math.ceil(config.max_growth_factor * capacity))


def peak_in_flight(samples: Iterable[Sample], now_s: float, window_s: float) -> float | None:
    """The largest ``in_flight`` of the samples in ``(now_s - window_s, now_s]``; None when there are none.

        >>> samples = (Sample(0.0, 9.0), Sample(15.0, 3.0), Sample(20.0, 5.0))
        >>> peak_in_flight(samples, now_s=20.0, window_s=20.0), peak_in_flight(samples, 40.0, 10.0)
        (5.0, None)
    """
    values = [s.in_flight for s in samples if now_s - window_s < s.at_s <= now_s]
    return max(values) if values else None


def _last_traffic_s(signals: HorizontalSignals, state: HorizontalState, now_s: float) -> float | None:
    seen = [s.at_s for s in signals.samples if s.in_flight > 0 and s.at_s <= now_s]
    if signals.waiting_requests > 0:
        seen.append(now_s)
    if state.last_traffic_s is not None:
        seen.append(state.last_traffic_s)
    return max(seen) if seen else None


def decide(signals: HorizontalSignals, config: HorizontalConfig, state: HorizontalState,
           now_s: float) -> tuple[Decision, HorizontalState]:
    """One decision of the horizontal policy, and the state to hand to the next call.

    A ramp to 37 requests in flight with 2 replicas ready, target 4: ceil(37 / 4) = 10, which
    the growth limit (2 → max(2 + 4, 2 × 2) = 6) caps for this cycle.

        >>> config = HorizontalConfig(min_replicas=1, max_replicas=20, target=4)
        >>> signals = HorizontalSignals((Sample(99.0, 20.0), Sample(100.0, 37.0)), ready_replicas=2,
        ...                             starting_replicas=0)
        >>> decision, state = decide(signals, config, initial_state(2, now_s=0.0), now_s=100.0)
        >>> decision.replicas, decision.rule, state.desired
        (6, 'scale-up', 6)
        >>> print(decision.reason.replace(", capped", ",\\n capped"))
        in flight 37.0 over the last 20 s / target 4 = 10 replicas,
         capped at growth limit 6 (2 × capacity 2, at least +4)
    """
    capacity = signals.ready_replicas + signals.starting_replicas
    up_due = state.last_scale_up_check_s is None or now_s - state.last_scale_up_check_s >= config.scale_up_interval_s
    last_traffic_s = _last_traffic_s(signals, state, now_s)
    inputs = {"now_s": now_s, "target": config.target, "ready_replicas": signals.ready_replicas,
              "starting_replicas": signals.starting_replicas, "capacity": capacity,
              "waiting_requests": signals.waiting_requests, "desired_before": state.desired,
              "in_flight_peak_up": peak_in_flight(signals.samples, now_s, config.scale_up_window_s),
              "in_flight_peak_down": peak_in_flight(signals.samples, now_s, config.scale_down_window_s),
              "history_s": now_s - state.history_since_s, "last_traffic_s": last_traffic_s,
              "scale_up_checked": up_due}
    replicas, rule, reason = _choose(signals, config, state, now_s, inputs, up_due)
    replicas, rule, reason = _within_bounds(replicas, rule, reason, config)
    new_state = replace(state, desired=replicas, last_traffic_s=last_traffic_s,
                        last_scale_up_check_s=now_s if up_due else state.last_scale_up_check_s)
    return Decision(replicas, rule, reason, inputs), new_state


def _choose(signals: HorizontalSignals, config: HorizontalConfig, state: HorizontalState, now_s: float,
            inputs: dict, up_due: bool) -> tuple[int, str, str]:
    """The rules in order: from zero, scale up, then a reduction (to zero or down) if allowed, else hold."""
    target, capacity, waiting = config.target, inputs["capacity"], signals.waiting_requests
    if waiting > 0 and capacity == 0:
        want = max(replicas_for(waiting, target), 1)
        limit = inputs["growth_limit"] = growth_limit(0, config)
        capped = f", capped at growth limit {limit}" if want > limit else ""
        return (max(state.desired, min(want, limit)), "from-zero",
                f"{waiting} request(s) waiting with no replica ready or starting: {waiting} / target {target:g} "
                f"= {want} replica(s){capped}")
    if up_due:
        demand = max(inputs["in_flight_peak_up"] or 0.0, float(waiting))
        want = inputs["want_up"] = replicas_for(demand, target)
        # Compared with the last order, which includes the replicas still loading: no re-order while they load.
        if want > state.desired:
            limit = inputs["growth_limit"] = growth_limit(capacity, config)
            replicas = max(state.desired, min(want, limit))
            if replicas > state.desired:
                if want > limit:
                    note = (f", capped at growth limit {limit} ({config.max_growth_factor:g} × capacity {capacity}, "
                            f"at least +{config.growth_allowance_replicas})")
                else:
                    note = ", already ready or starting: no new replica" if want <= capacity else ""
                return (replicas, "scale-up", f"in flight {demand:.1f} over the last {config.scale_up_window_s:g} s / "
                        f"target {target:g} = {want} replicas{note}")
    peak_down = inputs["in_flight_peak_down"]
    if peak_down is None:
        return state.desired, "no-samples", f"no in-flight samples in the last {config.scale_down_window_s:g} s: " \
            f"holding {state.desired} replicas"
    idle_since_s = state.history_since_s if inputs["last_traffic_s"] is None else \
        max(inputs["last_traffic_s"], state.history_since_s)
    idle_s = inputs["idle_s"] = now_s - idle_since_s
    want_down = inputs["want_down"] = max(replicas_for(peak_down, target), config.min_replicas, 1)
    if config.min_replicas == 0 and idle_s >= config.scale_to_zero_grace_s:
        candidate, rule = 0, "scale-to-zero"
        why = f"no traffic for {idle_s:.0f} s (grace {config.scale_to_zero_grace_s:g} s)"
    else:
        candidate, rule = want_down, "scale-down"
        why = (f"in flight peaked at {peak_down:.1f} over the last {config.scale_down_window_s:g} s / target "
               f"{target:g} = {want_down} replicas")
    if candidate >= state.desired:
        return state.desired, "hold", f"{why}; holding {state.desired} replicas ({capacity} ready or starting)"
    history_s = inputs["history_s"]
    if history_s < config.scale_down_window_s:
        return state.desired, "no-history", f"{why}, but the samples cover only {history_s:.0f} s of the " \
            f"{config.scale_down_window_s:g} s a reduction needs: holding {state.desired}"
    if signals.starting_replicas > 0 and candidate < signals.ready_replicas:
        # While replicas load, a reduction only cancels orders the lookback no longer justifies: a ready
        # replica is not stopped before the new capacity serves.
        if signals.ready_replicas >= state.desired:
            return state.desired, "loading", f"{why}, but {signals.starting_replicas} replica(s) are still " \
                f"loading: holding the {signals.ready_replicas} ready"
        return signals.ready_replicas, "loading", f"{why}, but {signals.starting_replicas} replica(s) are still " \
            f"loading: cancelling the orders beyond the {signals.ready_replicas} ready, {state.desired} → " \
            f"{signals.ready_replicas}"
    return candidate, rule, f"{why}: {state.desired} → {candidate}"


def _within_bounds(replicas: int, rule: str, reason: str, config: HorizontalConfig) -> tuple[int, str, str]:
    if replicas > config.max_replicas:
        return config.max_replicas, "max", f"{reason}, capped at max_replicas {config.max_replicas}"
    if replicas < config.min_replicas:
        return config.min_replicas, "min", f"{reason}, raised to min_replicas {config.min_replicas}"
    return replicas, rule, reason
