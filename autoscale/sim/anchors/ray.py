"""Ray Serve's default autoscaling policy: ongoing requests with upscale and downscale delays."""

from __future__ import annotations

from autoscale.sim.anchors.base import _Anchor, _EPSILON, _Samples, _ceil, view_at  # noqa: F401 - the doctests use view_at
from autoscale.sim.view import FleetView


RAY_SERVE_DEFAULT_TARGET_ONGOING_REQUESTS = 2.0  # ray/serve/_private/constants.py


class RayServe(_Anchor):
    """Ray Serve's default policy, ``replica_queue_length_autoscaling_policy``.

    ``target_per_replica`` plays ``target_ongoing_requests`` (Ray's default is
    :data:`RAY_SERVE_DEFAULT_TARGET_ONGOING_REQUESTS` = 2; pass it to run the literal default).
    Every ``metrics_interval_s`` (10 s) the controller receives the mean in flight of the last
    ``look_back_period_s`` (30 s). Each decision, with ``running`` = ready replicas and ``target``
    = the current order (``view.desired``): ``desired = running × total / (target_ongoing ×
    running)``; ``ceil(running + factor × (desired − running))`` with ``upscaling_factor`` /
    ``downscaling_factor`` 1.0 (the deprecated ``upscale_smoothing_factor`` etc. fall back to
    ``smoothing_factor`` 1.0); bounds; then the delay: a change is ordered once the same direction
    has been decided continuously for ``upscale_delay_s`` (30 s) or ``downscale_delay_s`` (600 s;
    ``downscale_to_zero_delay_s`` for 1 → 0), to the latest count. With no replica running the cold
    start path orders ``max(1, target)`` if requests are in flight, else ``target``.

    Sources: ray-project/ray ``python/ray/serve/autoscaling_policy.py`` (``_apply_delay_logic``,
    ``_apply_scaling_factors``, ``_get_cold_start_scale_up_replicas``), ``serve/config.py``
    (``AutoscalingConfig`` defaults), ``serve/_private/constants.py`` (control loop 0.1 s,
    target 2); https://docs.ray.io/en/latest/serve/advanced-guides/advanced-autoscaling.html.
    Approximations: Ray decides every 0.1 s and counted consecutive decisions
    (``delay_s / 0.1``) until ray-project/ray#62331 measured the delay in time; here a decision
    each call (1 s) and the delay in time, which agree when no loop step runs slow. Replicas'
    0.5 s samples and time-weighted merge are one mean of per-second samples per push.

    37 in flight at 4 per replica from 1 replica: 10 wanted from t = 0, ordered at t = 30.

        >>> ray = RayServe(4, min_replicas=1, max_replicas=20, initial_replicas=1)
        >>> ray.decide(view_at(0.0, 37.0, ready=1)), ray.decide(view_at(29.0, 37.0, ready=1))
        (1, 1)
        >>> ray.decide(view_at(30.0, 37.0, ready=1))
        10
    """

    name = "ray_serve"

    def __init__(self, target_per_replica: float, min_replicas: int, max_replicas: int, initial_replicas: int, *,
                 upscale_delay_s: float = 30.0, downscale_delay_s: float = 600.0,
                 downscale_to_zero_delay_s: float | None = None, look_back_period_s: float = 30.0,
                 metrics_interval_s: float = 10.0, upscaling_factor: float = 1.0,
                 downscaling_factor: float = 1.0) -> None:
        super().__init__(target_per_replica, min_replicas, max_replicas, initial_replicas, metrics_interval_s)
        self.upscale_delay_s, self.downscale_delay_s = upscale_delay_s, downscale_delay_s
        self.downscale_to_zero_delay_s = downscale_to_zero_delay_s
        self.look_back_period_s = look_back_period_s
        self.upscaling_factor, self.downscaling_factor = upscaling_factor, downscaling_factor
        self._samples = _Samples(look_back_period_s)
        self._total = 0.0
        self._streak: tuple[int, float] | None = None  # (direction, since_s)

    def decide(self, view: FleetView) -> int:
        now_s, target_num = view.now_s, view.desired
        self._samples.add(now_s, view.in_flight)
        if self._due(now_s):  # a metrics push
            self._total = self._samples.mean(now_s, self.look_back_period_s)
        if view.ready == 0:
            if self._total > 0:
                return self._order(max(_ceil(self.upscaling_factor), target_num))
            return self._order(target_num)
        running = view.ready
        desired = running * (self._total / (self.target * running))
        factor = self.upscaling_factor if desired > running else self.downscaling_factor
        scaled = _ceil(running + factor * (desired - running))
        if _ceil(desired) < running and scaled == running:
            scaled -= 1
        bounded = max(self.min_replicas, min(self.max_replicas, scaled))
        return self._order(self._after_delay(bounded, target_num, now_s))

    def _after_delay(self, wanted: int, target_num: int, now_s: float) -> int:
        if wanted == target_num:
            self._streak = None
            return target_num
        direction = 1 if wanted > target_num else -1
        delay_s = self.upscale_delay_s
        if direction < 0:
            to_zero = target_num == 1
            delay_s = self.downscale_to_zero_delay_s if to_zero and self.downscale_to_zero_delay_s is not None \
                else self.downscale_delay_s
            wanted = wanted if to_zero else max(1, wanted)
        if self._streak is None or self._streak[0] != direction:
            self._streak = (direction, now_s)
        if now_s - self._streak[1] >= delay_s - _EPSILON:
            self._streak = None
            return wanted
        return target_num
