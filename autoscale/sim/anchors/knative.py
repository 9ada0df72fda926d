"""Knative Serving's KPA at its defaults: stable and panic windows on concurrency."""

from __future__ import annotations

from collections import deque

from autoscale.sim.anchors.base import _Anchor, _Samples, _ceil, rate_bounds, view_at  # noqa: F401 - the doctests use view_at
from autoscale.sim.view import FleetView


class KnativeKPA(_Anchor):
    """Knative Serving's KPA on concurrency, with the cluster defaults of ``config-autoscaler``.

    Concurrency is sampled every second (the scraper's ``scrapeTickInterval``, 1 s buckets) and
    averaged over the stable window (60 s) and the panic window (10 % of it: 6 s), partial windows
    averaged over what they hold. Every 2 s (``tickInterval``), with ``pods = max(1, ready)`` and
    ``target = 0.7 × target_per_replica`` (``container-concurrency-target-percentage``):
    ``dspc = ceil(stable / target)``, ``dppc = ceil(panic / target)``, each kept within
    :func:`rate_bounds` (up 1000 ×, down ÷ 2). Panic begins, or is extended, when
    ``dppc / pods ≥ 2`` (200 %); it ends at the first decision more than a stable window after the
    last one over the threshold. In panic the order is the highest of max(stable, panic) since
    panic began (never down); otherwise the stable count. An autoscaler created with more than
    one pod ready starts in panic holding them. ``scale-down-delay`` is 0 (no delay window).

    Sources: knative/serving @ 98e5ef9 (Aug 2026) ``pkg/autoscaler/scaling/autoscaler.go``
    (``Scale``, ``newAutoscaler``), ``scaling/multiscaler.go`` (tick 2 s),
    ``config/config.go`` (defaults), ``aggregation/bucketing.go`` (``TimedFloat64Buckets``
    average, rounded to 6 digits), ``reconciler/autoscaling/resources/target.go`` (target × 0.7);
    https://knative.dev/docs/serving/autoscaling/kpa-specific/. Approximations: the activator,
    burst capacity and the scale-to-zero grace period are not modelled (bounds apply directly).

    50 in flight at target 10 (7 effective) from 1 pod: the panic window sees 50, dppc =
    ceil(50 / 7) = 8 and 8 / 1 ≥ 2: panic, order 8 at once.

        >>> kpa = KnativeKPA(10, min_replicas=1, max_replicas=100, initial_replicas=1)
        >>> kpa.decide(view_at(0.0, 50.0, ready=1)), kpa.panicking
        (8, True)
    """

    name = "knative_kpa"

    def __init__(self, target_per_replica: float, min_replicas: int, max_replicas: int, initial_replicas: int, *,
                 tick_interval_s: float = 2.0, stable_window_s: float = 60.0, panic_window_percentage: float = 10.0,
                 panic_threshold_percentage: float = 200.0, target_utilization: float = 0.7,
                 max_scale_up_rate: float = 1000.0, max_scale_down_rate: float = 2.0,
                 scale_down_delay_s: float = 0.0) -> None:
        super().__init__(target_per_replica, min_replicas, max_replicas, initial_replicas, tick_interval_s)
        self.stable_window_s = stable_window_s
        self.panic_window_s = max(round(stable_window_s * panic_window_percentage / 100), 1.0)
        self.panic_threshold = panic_threshold_percentage / 100
        self.target_value = max(0.01, self.target * target_utilization)
        self.max_scale_up_rate, self.max_scale_down_rate = max_scale_up_rate, max_scale_down_rate
        self.scale_down_delay_s = scale_down_delay_s
        self._samples = _Samples(stable_window_s)
        self._delayed: deque[tuple[float, int]] = deque()
        self._panic_time_s: float | None = None
        self._max_panic_pods = 0
        self._created = False

    @property
    def panicking(self) -> bool:
        return self._panic_time_s is not None

    def decide(self, view: FleetView) -> int:
        now_s = view.now_s
        self._samples.add(now_s, view.in_flight)
        if not self._created:  # newAutoscaler: more than one pod ready starts in panic, holding them
            self._created = True
            if view.ready > 1:
                self._panic_time_s, self._max_panic_pods = now_s, view.ready
        if not self._due(now_s):
            return self._desired
        pods = max(1, view.ready)
        stable = round(self._samples.mean(now_s, self.stable_window_s), 6)
        panic = round(self._samples.mean(now_s, self.panic_window_s), 6)
        lowest, highest = rate_bounds(pods, self.max_scale_up_rate, self.max_scale_down_rate)
        dspc, dppc = _ceil(stable / self.target_value), _ceil(panic / self.target_value)
        desired_stable, desired_panic = (min(max(d, lowest), highest) for d in (dspc, dppc))
        if dppc / pods >= self.panic_threshold:
            self._panic_time_s = now_s
        elif self.panicking and self._panic_time_s + self.stable_window_s < now_s:
            self._panic_time_s, self._max_panic_pods = None, 0
        desired = desired_stable
        if self.panicking:
            self._max_panic_pods = max(self._max_panic_pods, desired_stable, desired_panic)
            desired = self._max_panic_pods
        if self.scale_down_delay_s > 0:
            self._delayed.append((now_s, desired))
            while self._delayed[0][0] <= now_s - self.scale_down_delay_s:
                self._delayed.popleft()
            desired = max(d for _, d in self._delayed)
        return self._order(desired)
