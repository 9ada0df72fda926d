"""Kubernetes' HorizontalPodAutoscaler on a pods metric, at its defaults."""

from __future__ import annotations

from autoscale.sim.anchors.base import _Anchor, _ceil, view_at  # noqa: F401 - the doctests use view_at
from autoscale.sim.view import FleetView


def pods_metric_replicas(in_flight: float, ready: int, starting: int, current: int, target: float,
                         tolerance: float) -> int | None:
    """Kubernetes' ``calcPlainMetricReplicas`` for a pods metric; None when no pod reports one.

    ``ratio = (in_flight / ready) / target``. Without starting pods: ``current`` within the
    tolerance, else ``ceil(ratio × ready)``. Starting pods have no metric yet ("missing"): on a
    scale-up they count as pods at 0, on a scale-down as pods at the target, and the ratio is
    recomputed over ready + starting; ``current`` if it is then within the tolerance or changes
    direction. 26 in flight, target 4, 2 ready: 26 / 8 = 3.25 → 7 replicas; with 4 more starting,
    26 / 24 = 1.08 is within 10 %: hold 6.

        >>> pods_metric_replicas(26, ready=2, starting=0, current=2, target=4, tolerance=0.1)
        7
        >>> pods_metric_replicas(26, ready=2, starting=4, current=6, target=4, tolerance=0.1)
        6
    """
    if ready == 0:
        return None
    ratio = in_flight / ready / target

    def within(r: float) -> bool:
        return 1.0 - tolerance <= r <= 1.0 + tolerance

    if starting == 0:
        return current if within(ratio) else _ceil(ratio * ready)
    if ratio == 1.0:
        return current
    pods = ready + starting
    new_ratio = (in_flight + (starting * target if ratio < 1.0 else 0.0)) / pods / target
    if within(new_ratio) or (ratio < 1.0) != (new_ratio < 1.0):
        return current
    replicas = _ceil(new_ratio * pods)
    if (new_ratio < 1.0 and replicas > current) or (new_ratio > 1.0 and replicas < current):
        return current
    return replicas


class KubernetesHPA(_Anchor):
    """Kubernetes' HorizontalPodAutoscaler (autoscaling/v2) on a pods metric of in flight per pod.

    As a Prometheus-adapter concurrency metric: ``type: Pods``, ``target.averageValue`` =
    ``target_per_replica``. Every ``sync_period_s`` (15 s), with ``current`` the spec's count
    (``view.desired``):

    1. :func:`pods_metric_replicas` recommends a count (``replica_calculator.go``; tolerance 0.1);
       with no pod ready there is no metric and the HPA holds ("did not receive metrics");
    2. ``stabilizeRecommendationWithBehaviors``: a scale-down goes no lower than the highest
       recommendation of the last ``scale_down_stabilization_s`` (300 s); the first sync records
       ``current`` as one (``recordInitialRecommendation``), so a new HPA waits 300 s to scale down;
    3. ``convertDesiredReplicasWithBehaviorRate``, default behavior: up to max(+4 pods, +100 %)
       per 15 s, down by up to 100 % per 15 s, from the count at the period's start; then bounds.

    Sources: kubernetes/kubernetes ``pkg/controller/podautoscaler/horizontal.go``,
    ``replica_calculator.go`` (1.33+, ``Tolerances``), ``pkg/apis/autoscaling/v2/defaults.go``,
    ``config/v1alpha1/defaults.go`` (sync 15 s, tolerance 0.1, downscale window 5 min);
    https://kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/.
    Approximations: the first sync is at the first tick (the controller's queue delays it up to
    15 s); the metric is the in flight at the sync, spread evenly over ready pods (no scrape or
    adapter lag); starting replicas are "missing" pods (Running, not reporting yet), not Pending
    ones. An HPA whose spec has no ``behavior`` runs the legacy path, capped at
    max(2 × current, 4), which differs only below 4 replicas (1 → 4 instead of 5).

    37 in flight at 4 per replica from 1 replica: ceil(37 / 4) = 10, but one sync adds at most
    max(4, 100 % of 1) = 4 → 5; 15 s later 5 may grow to max(5 + 4, 10) = 10.

        >>> hpa = KubernetesHPA(4, min_replicas=1, max_replicas=20, initial_replicas=1)
        >>> hpa.decide(view_at(0.0, 37.0, ready=1)), hpa.decide(view_at(1.0, 37.0, ready=5))
        (5, 5)
        >>> hpa.decide(view_at(15.0, 37.0, ready=5))
        10
    """

    name = "hpa"

    def __init__(self, target_per_replica: float, min_replicas: int, max_replicas: int, initial_replicas: int, *,
                 sync_period_s: float = 15.0, tolerance: float = 0.1, scale_up_pods: int = 4,
                 scale_up_percent: float = 100.0, scale_up_period_s: float = 15.0, scale_down_percent: float = 100.0,
                 scale_down_period_s: float = 15.0, scale_down_stabilization_s: float = 300.0) -> None:
        super().__init__(target_per_replica, min_replicas, max_replicas, initial_replicas, sync_period_s)
        self.tolerance = tolerance
        self.scale_up_pods, self.scale_up_percent, self.scale_up_period_s = scale_up_pods, scale_up_percent, \
            scale_up_period_s
        self.scale_down_percent, self.scale_down_period_s = scale_down_percent, scale_down_period_s
        self.scale_down_stabilization_s = scale_down_stabilization_s
        self._recommendations: list[tuple[float, int]] | None = None
        self._events: list[tuple[float, int]] = []  # (at_s, replicas added: negative for removed)

    def decide(self, view: FleetView) -> int:
        now_s, current = view.now_s, view.desired
        if not self._due(now_s):
            return self._desired
        if self._recommendations is None:
            self._recommendations = [(now_s, current)]
        if current > self.max_replicas or current < self.min_replicas:
            return self._rescale(current, self.max_replicas if current > self.max_replicas else self.min_replicas,
                                 now_s)
        recommended = pods_metric_replicas(view.in_flight, view.ready, view.starting, current, self.target,
                                           self.tolerance)
        if recommended is None:
            return self._order(current)
        stabilized = self._stabilize(recommended, current, now_s)
        return self._rescale(current, self._within_rate(stabilized, current, now_s), now_s)

    def _stabilize(self, recommended: int, current: int, now_s: float) -> int:
        window_s = self.scale_down_stabilization_s
        self._recommendations = [(t, r) for t, r in self._recommendations if t > now_s - window_s]
        highest = max([recommended] + [r for _, r in self._recommendations])
        self._recommendations.append((now_s, recommended))
        # Scale-up stabilization is 0 s: the new recommendation is the lower limit.
        return min(max(current, recommended), highest)

    def _within_rate(self, desired: int, current: int, now_s: float) -> int:
        def changed_since(period_s: float) -> int:
            return sum(n for t, n in self._events if t > now_s - period_s)

        if desired > current:
            start = current - changed_since(self.scale_up_period_s)
            limit = max(start + self.scale_up_pods, _ceil(start * (1 + self.scale_up_percent / 100)))
            return min(desired, max(limit, current), self.max_replicas)
        if desired < current:
            start = current - changed_since(self.scale_down_period_s)
            limit = int(start * (1 - self.scale_down_percent / 100))
            return max(desired, min(limit, current), self.min_replicas)
        return desired

    def _rescale(self, current: int, desired: int, now_s: float) -> int:
        if desired != current:
            period_s = max(self.scale_up_period_s, self.scale_down_period_s)
            self._events = [(t, n) for t, n in self._events if t > now_s - period_s] + [(now_s, desired - current)]
        return self._order(desired)
