"""What every anchor shares: the window of per-second samples, bounds, cadence, and small helpers."""

from __future__ import annotations

import math
from collections import deque

from autoscale.sim.view import FleetView

_EPSILON = 1e-9


def _ceil(x: float) -> int:
    return math.ceil(x - _EPSILON)


def view_at(now_s: float, in_flight: float, ready: int, desired: int | None = None, starting: int = 0) -> FleetView:
    """A :class:`FleetView` with the fields the anchors read; ``desired`` defaults to ready + starting."""
    ordered = ready + starting if desired is None else desired
    return FleetView(now_s=now_s, in_flight=in_flight, running=in_flight, queued=0.0, ready=ready, starting=starting,
                     desired=ordered, arrivals_rps=0.0, p99_latency_ms=None, utilization=0.0)


def rate_bounds(pods: float, max_scale_up_rate: float, max_scale_down_rate: float) -> tuple[int, int]:
    """The lowest and highest count one KPA decision may order from ``pods``.

    ``(floor(pods / down_rate), max(1, ceil(up_rate × pods)))``, from Knative's
    ``scaling/autoscaler.go`` (which passes ``max(1, ready)``) and AIBrix's ``algorithm/kpa.go``.
    Knative's rates (1000, 2) from 10 pods: 5 to 10,000; AIBrix's (2, 2): 5 to 20; from 0: 0 to 1.

        >>> rate_bounds(10, 1000, 2), rate_bounds(10, 2, 2), rate_bounds(0, 2, 2)
        ((5, 10000), (5, 20), (0, 1))
    """
    return math.floor(pods / max_scale_down_rate), max(1, _ceil(max_scale_up_rate * pods))


class _Samples:
    """Timestamped values, oldest first, kept for ``keep_s``; the mean of those in a window."""

    def __init__(self, keep_s: float) -> None:
        self._keep_s = keep_s
        self._items: deque[tuple[float, float]] = deque()

    def add(self, at_s: float, value: float) -> None:
        self._items.append((at_s, value))
        while self._items[0][0] < at_s - self._keep_s:
            self._items.popleft()

    def mean(self, now_s: float, window_s: float, *, oldest_included: bool = False) -> float:
        """Mean over ``(now - window, now]`` (``[now - window, now]`` with ``oldest_included``); 0 if empty."""
        values = [v for t, v in self._items if now_s - t < window_s or (oldest_included and now_s - t <= window_s)]
        return sum(values) / len(values) if values else 0.0


class _Anchor:
    """Bounds, the cadence of decisions and the last order, common to the metric-driven anchors."""

    name = "anchor"

    def __init__(self, target_per_replica: float, min_replicas: int, max_replicas: int, initial_replicas: int,
                 period_s: float) -> None:
        if not target_per_replica > 0:
            raise ValueError(f"target_per_replica must be > 0 requests in flight, got {target_per_replica}")
        if not 0 <= min_replicas <= initial_replicas <= max_replicas or max_replicas < 1:
            raise ValueError(f"need 0 ≤ min_replicas ≤ initial_replicas ≤ max_replicas and max_replicas ≥ 1, got "
                             f"{min_replicas}, {initial_replicas}, {max_replicas}")
        self.target = float(target_per_replica)
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        self._desired = initial_replicas
        self._period_s = period_s
        self._last_s: float | None = None

    def _due(self, now_s: float) -> bool:
        """True on the first call and once ``period_s`` has passed since the last decision."""
        if self._last_s is not None and now_s - self._last_s < self._period_s - _EPSILON:
            return False
        self._last_s = now_s
        return True

    def _order(self, replicas: int) -> int:
        self._desired = max(self.min_replicas, min(self.max_replicas, replicas))
        return self._desired


class StaticPeak:
    """The same count every tick: the fleet sized for the day's peak, never scaled.

        >>> StaticPeak(12).decide(view_at(0.0, in_flight=0.0, ready=12))
        12
    """

    name = "static_peak"

    def __init__(self, replicas: int) -> None:
        if replicas < 0:
            raise ValueError(f"replicas must be ≥ 0, got {replicas}")
        self.replicas = replicas

    def decide(self, view: FleetView) -> int:
        return self.replicas
