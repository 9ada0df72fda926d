"""AIBrix's KPA at its defaults: a Knative port with its own windows, rates and differences."""

from __future__ import annotations

from autoscale.sim.anchors.base import _Anchor, _Samples, _ceil, rate_bounds, view_at  # noqa: F401 - the doctests use view_at
from autoscale.sim.view import FleetView


def aibrix_cooldown(history: tuple[tuple[float, int], ...], recommended: int, current: int, now_s: float,
                    up_window_s: float, down_window_s: float) -> tuple[int, tuple[tuple[float, int], ...]]:
    """AIBrix's ``stabilizeRecommendation``: the count to order, and the history to keep.

    The recommendation joins the history. Above ``current`` the result is the highest of the
    last ``up_window_s`` (0 s: the recommendation itself); below, the *lowest* of the last
    ``down_window_s`` (300 s), so the "cooldown" never delays a scale-down: it repeats the lowest
    recent recommendation. At 250 s with 10 ordered, a 9 after a 3 at 100 s orders 3.

        >>> aibrix_cooldown(((100.0, 3), (200.0, 10)), 9, current=10, now_s=250.0, up_window_s=0, down_window_s=300)[0]
        3
        >>> aibrix_cooldown(((100.0, 3),), 12, current=10, now_s=250.0, up_window_s=0, down_window_s=300)[0]
        12
    """
    kept = tuple((t, r) for t, r in history if t > now_s - max(up_window_s, down_window_s)) + ((now_s, recommended),)
    if recommended == current:
        return current, kept
    scaling_up = recommended > current
    window = [r for t, r in kept if t > now_s - (up_window_s if scaling_up else down_window_s)]
    if not window:
        return recommended, kept
    return (max(window) if scaling_up else min(window)), kept


_FOLLOW_UP_RECONCILES = 32  # enough to double from 1 past any max_replicas


class AIBrixKPA(_Anchor):
    """AIBrix's KPA (``scalingStrategy: KPA``), which ports Knative's with other defaults and rules.

    Every ``sync_period_s`` (10 s, the controller's resync) one value is recorded and averaged
    over the observe (stable) window, 180 s, and the panic window, 60 s, both inclusive. With
    ``current`` the spec's count (``view.desired``): panic is decided afresh each time,
    ``stable ≤ 0 or panic / stable > 2`` (panic threshold 2.0; no state, no hold);
    ``dspc = ceil(stable / target)`` unless the value lies within the tolerances
    (``target × 0.9 ≤ stable ≤ target × 1.1``), then ``current``; ``dppc`` likewise; each kept
    within :func:`rate_bounds` of ``current`` (up 2 ×, down ÷ 2); in panic the higher of the two,
    else the stable one; bounds; then :func:`aibrix_cooldown` (up 0 s, down 300 s); bounds.
    A change writes the PodAutoscaler's status, and the controller watches PodAutoscalers with
    no predicate (``For(&PodAutoscaler{})``), so it reconciles again at once on the same metrics
    and the new ``current``, until the order stops changing (``follow_up_reconciles``).

    ``metric_source`` chooses what is recorded. ``"external"`` (default): one value for the
    endpoint, its total in flight, which the total-style ``ceil(value / target)`` expects.
    ``"pod"``: AIBrix averages the ready pods' values (``metrics/client.go`` ``UpdateMetrics``),
    so ``ceil(mean per pod / target)`` is not a replica count: at 40 in flight, target 4, it
    hovers around 4 replicas instead of 10. This reproduces the code as it is, for a pod metric
    such as ``vllm:num_requests_running``; with no pod ready nothing is recorded and AIBrix holds.

    Sources: vllm-project/aibrix v0.7.0 (= main @ e3e10f9, Aug 2026, for these files)
    ``pkg/controller/podautoscaler/algorithm/kpa.go``, ``context/context.go`` (defaults),
    ``metrics/client.go`` (windows 180 s / 60 s), ``types/metrics.go`` (``TimeWindow.Avg``),
    ``podautoscaler_controller.go`` (resync 10 s, ``stabilizeRecommendation``, watches);
    docs/source/features/autoscaling/metric-based-autoscaling.rst. Approximations: a follow-up
    reconcile happens within the tick (in the cluster, within milliseconds); the pending-replica
    guard of vllm-project/aibrix#2671, merged after v0.7.0, is not modelled.

    37 in flight at 4 per replica from 1 replica: ceil(37 / 4) = 10, one reconcile at most
    doubles, and each doubling triggers the next: 1 → 2 → 4 → 8 → 10 at the first sync. Without
    the follow-ups, one step per 10 s.

        >>> AIBrixKPA(4, min_replicas=1, max_replicas=20, initial_replicas=1).decide(view_at(0.0, 37.0, ready=1))
        10
        >>> aibrix = AIBrixKPA(4, min_replicas=1, max_replicas=20, initial_replicas=1, follow_up_reconciles=False)
        >>> [aibrix.decide(view_at(t, 37.0, ready=r)) for t, r in ((0.0, 1), (10.0, 2), (20.0, 4), (30.0, 8))]
        [2, 4, 8, 10]
    """

    name = "aibrix_kpa"

    def __init__(self, target_per_replica: float, min_replicas: int, max_replicas: int, initial_replicas: int, *,
                 metric_source: str = "external", sync_period_s: float = 10.0, stable_window_s: float = 180.0,
                 panic_window_s: float = 60.0, panic_threshold: float = 2.0, max_scale_up_rate: float = 2.0,
                 max_scale_down_rate: float = 2.0, scale_up_tolerance: float = 0.1, scale_down_tolerance: float = 0.1,
                 scale_up_cooldown_s: float = 0.0, scale_down_cooldown_s: float = 300.0,
                 follow_up_reconciles: bool = True) -> None:
        super().__init__(target_per_replica, min_replicas, max_replicas, initial_replicas, sync_period_s)
        if metric_source not in ("external", "pod"):
            raise ValueError(f"metric_source must be 'external' or 'pod', got {metric_source!r}")
        self.metric_source = metric_source
        self.stable_window_s, self.panic_window_s, self.panic_threshold = stable_window_s, panic_window_s, \
            panic_threshold
        self.max_scale_up_rate, self.max_scale_down_rate = max_scale_up_rate, max_scale_down_rate
        self.scale_up_tolerance, self.scale_down_tolerance = scale_up_tolerance, scale_down_tolerance
        self.scale_up_cooldown_s, self.scale_down_cooldown_s = scale_up_cooldown_s, scale_down_cooldown_s
        self._samples = _Samples(max(stable_window_s, panic_window_s))
        self.follow_up_reconciles = follow_up_reconciles
        self._history: tuple[tuple[float, int], ...] = ()

    def decide(self, view: FleetView) -> int:
        now_s, current = view.now_s, view.desired
        if not self._due(now_s):
            return self._desired
        if not self.min_replicas <= current <= self.max_replicas:
            return self._order(current)
        if self.metric_source == "pod":
            if view.ready == 0:
                return self._order(current)
            self._samples.add(now_s, view.in_flight / view.ready)
        else:
            self._samples.add(now_s, view.in_flight)
        stable = self._samples.mean(now_s, self.stable_window_s, oldest_included=True)
        panic = self._samples.mean(now_s, self.panic_window_s, oldest_included=True)
        for _ in range(1 + (_FOLLOW_UP_RECONCILES if self.follow_up_reconciles else 0)):
            ordered = self._reconcile(stable, panic, current, now_s)
            if ordered == current:
                break
            current = ordered  # the status write reconciles again, on the same metrics
        return self._order(current)

    def _reconcile(self, stable: float, panic: float, current: int, now_s: float) -> int:
        in_panic = stable <= 0 or panic / stable > self.panic_threshold
        lowest, highest = rate_bounds(current, self.max_scale_up_rate, self.max_scale_down_rate)
        up_threshold = self.target * (1 + self.scale_up_tolerance)
        down_threshold = self.target * (1 - self.scale_down_tolerance)

        def pods_for(value: float) -> int:
            wanted = _ceil(value / self.target) if value > up_threshold or value < down_threshold else current
            return min(max(wanted, lowest), highest)

        recommended = max(pods_for(stable), pods_for(panic)) if in_panic else pods_for(stable)
        recommended = max(self.min_replicas, min(self.max_replicas, recommended))
        ordered, self._history = aibrix_cooldown(self._history, recommended, current, now_s,
                                                 self.scale_up_cooldown_s, self.scale_down_cooldown_s)
        return max(self.min_replicas, min(self.max_replicas, ordered))
