"""Is a served endpoint healthy now, and did its new revision fail its bake? (pure logic, no I/O)

The ``endpoint_health`` asset check on ``served_endpoint`` is evaluated about every 30 s by
the health sensor (:mod:`pipelines.health`) from what the routers saw over their last 30 s
(answers, failed answers, p99), the replicas (ready against desired) and the heartbeats of
the routers and the autoscaler. It fails, with every problem named, when

- the p99 latency of successful answers is above the SLO;
- more than ``max_error_rate`` of the answers failed, over at least ``min_requests`` answers
  (a handful of answers says nothing about a rate): server errors (5xx), and 400s where the
  model raised on input that passed its signature (:mod:`serving.blame`); never a client's
  mistake, so no client can roll a good version back;
- fewer replicas are ready than the autoscaler asked for;
- no router, or no autoscaler, has reported for ``heartbeat_stale_s``.

**Bake.** For ``bake_window_s`` after a revision took an endpoint's traffic, stricter rules
apply, and breaking one rolls the endpoint back to the revision it replaced: an error rate
above ``bake_max_error_rate`` or a p99 above ``bake_p99_factor`` × the SLO, over at least
``min_requests`` answers. A slow start (p99 1.2 × the SLO) fails the check without a
rollback; a new version that errs on one answer in five is rolled back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HealthThresholds:
    max_error_rate: float = 0.01
    min_requests: int = 20
    heartbeat_stale_s: float = 30.0
    bake_window_s: float = 600.0
    bake_max_error_rate: float = 0.05
    bake_p99_factor: float = 2.0


@dataclass(frozen=True)
class HealthInputs:
    endpoint: str
    revision_id: str
    slo_p99_ms: float
    p99_latency_ms: float | None  # successful answers of the routers' last 30 s; None: none
    requests: int  # answers in that window
    errors: int  # of which failed: 5xx, or the model's fault (serving.blame)
    ready_replicas: int
    desired_replicas: int
    router_heartbeat_age_s: float | None  # None: no router ever reported
    autoscaler_heartbeat_age_s: float | None  # None: no autoscaler holds the lease
    serving_for_s: float  # since the revision took the endpoint's traffic


@dataclass(frozen=True)
class HealthReport:
    passed: bool
    problems: tuple[str, ...]
    rollback_reason: str | None  # set when a revision within its bake window broke a bake rule

    def describe(self) -> str:
        return "healthy" if self.passed else "; ".join(self.problems)


def error_rate(inputs: HealthInputs) -> float:
    return inputs.errors / inputs.requests if inputs.requests else 0.0


def assess(inputs: HealthInputs, thresholds: HealthThresholds = HealthThresholds()) -> HealthReport:
    """The check's verdict, every problem named with its numbers, and whether to roll back.

    >>> ok = HealthInputs("gec", "gec-v2-aa", 1000.0, 400.0, 500, 0, 2, 2, 1.0, 1.0, 3600.0)
    >>> assess(ok).passed
    True
    >>> from dataclasses import replace
    >>> bad = assess(replace(ok, errors=100, serving_for_s=60.0))
    >>> bad.problems[0], bad.rollback_reason
    ('20.0% of 500 answers failed (at most 1.0%)', '20.0% failed answers in its first 60 s (bake allows 5.0%)')
    """
    problems = []
    enough = inputs.requests >= thresholds.min_requests
    rate = error_rate(inputs)
    if enough and rate > thresholds.max_error_rate:
        problems.append(f"{rate:.1%} of {inputs.requests} answers failed "
                        f"(at most {thresholds.max_error_rate:.1%})")
    if inputs.p99_latency_ms is not None and inputs.p99_latency_ms > inputs.slo_p99_ms:
        problems.append(f"p99 {inputs.p99_latency_ms:.0f} ms is above the SLO of {inputs.slo_p99_ms:.0f} ms")
    if inputs.ready_replicas < inputs.desired_replicas:
        problems.append(f"{inputs.ready_replicas} of {inputs.desired_replicas} replicas ready")
    for what, age in (("router", inputs.router_heartbeat_age_s), ("autoscaler", inputs.autoscaler_heartbeat_age_s)):
        if age is None:
            problems.append(f"no {what} has reported")
        elif age > thresholds.heartbeat_stale_s:
            problems.append(f"the {what} last reported {age:.0f} s ago (stale after {thresholds.heartbeat_stale_s:.0f} s)")
    rollback = None
    if inputs.serving_for_s <= thresholds.bake_window_s and enough:
        if rate > thresholds.bake_max_error_rate:
            rollback = (f"{rate:.1%} failed answers in its first {inputs.serving_for_s:.0f} s "
                        f"(bake allows {thresholds.bake_max_error_rate:.1%})")
        elif inputs.p99_latency_ms is not None and inputs.p99_latency_ms > thresholds.bake_p99_factor * inputs.slo_p99_ms:
            rollback = (f"p99 {inputs.p99_latency_ms:.0f} ms in its first {inputs.serving_for_s:.0f} s, above "
                        f"{thresholds.bake_p99_factor:g} × the SLO of {inputs.slo_p99_ms:.0f} ms")
    return HealthReport(not problems, tuple(problems), rollback)
