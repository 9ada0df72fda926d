"""A rollout's canary phase (spec ``rollout``): the new revision takes ``canary_percent`` of
the requests for ``canary_duration_s`` beside the serving one, then is judged on its own answers.

What is compared: the routers' answers per revision over their last 30 s
(``GET /internal/in-flight``), read once per 30 s window so that no answer counts twice.
Across windows, answers and failed answers (5xx, and 400s where the model raised on input that
passed its signature: :mod:`serving.blame`) add up; the p99 is the highest window p99
(a bound on the phase's p99, never below it). The canary fails when

- its error rate exceeds the serving revision's by more than ``canary_max_error_increase``
  (absolute, e.g. 0.01 = one point), or
- its p99 exceeds both the SLO's ``p99_latency_ms`` and ``canary_max_p99_ratio`` × the serving
  revision's p99 (a canary is not blamed for a slowness both share).

A canary that received no answer in the phase passes, with that said: there was nothing to
judge it on, as there would be nothing for an immediate switch.

>>> judge(Tally(200, 9, 300.0), Tally(1800, 18, 280.0), slo_p99_ms=1000, max_error_increase=0.01, max_p99_ratio=1.2)
(False, 'the canary answered 9 of 200 requests with a failure (4.5%), the serving revision 1.0%: more than 1.0 points worse')
>>> judge(Tally(200, 2, 900.0), Tally(1800, 18, 280.0), slo_p99_ms=1000, max_error_increase=0.01, max_p99_ratio=1.2)[0]
True
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from assets.rollout import Canary, CanaryVerdict
from controlplane.revisions import RevisionStore
from controlplane.routers import RouterStore
from controlplane.splits import Share, SplitStore

WINDOW_S = 30.0  # the routers' latency window (serving.router.latency.LatencyWindow)


@dataclass(frozen=True)
class Tally:
    requests: int = 0
    errors: int = 0
    p99_ms: float | None = None

    def add(self, p99_ms: float | None, requests: int, errors: int) -> "Tally":
        highest = max((v for v in (self.p99_ms, p99_ms) if v is not None), default=None)
        return Tally(self.requests + requests, self.errors + errors, highest)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


def judge(canary: Tally, serving: Tally, slo_p99_ms: float, max_error_increase: float,
          max_p99_ratio: float) -> tuple[bool, str]:
    if canary.requests == 0:
        return True, "no request reached the canary during its phase; nothing to judge it on"
    if canary.error_rate > serving.error_rate + max_error_increase:
        return False, (f"the canary answered {canary.errors} of {canary.requests} requests with a failure "
                       f"({canary.error_rate:.1%}), the serving revision {serving.error_rate:.1%}: more than "
                       f"{100 * max_error_increase:.1f} points worse")
    if canary.p99_ms is not None and canary.p99_ms > slo_p99_ms and (
            serving.p99_ms is None or canary.p99_ms > max_p99_ratio * serving.p99_ms):
        return False, (f"the canary's p99 was {canary.p99_ms:.0f} ms, over the SLO's {slo_p99_ms:.0f} ms and over "
                       f"{max_p99_ratio:g} × the serving revision's ({serving.p99_ms or 0:.0f} ms)")
    return True, (f"the canary answered {canary.requests} requests, {canary.error_rate:.1%} failed, p99 "
                  f"{canary.p99_ms or 0:.0f} ms (serving: {serving.error_rate:.1%}, {serving.p99_ms or 0:.0f} ms)")


@dataclass
class CanaryPhase:
    """Runs a :class:`Canary` action: set the split, watch the windows, clear it, judge.

    ``read_load`` returns ``{endpoint: EndpointLoad}`` (``autoscale.controller.sources.router_loads``);
    ``sleep`` and ``monotonic`` are injected so tests run the phase without waiting. The
    revision is marked ``canary_phase`` in its details while the phase runs: should the run die
    in the middle, the reaper knows the split for what it is and retires the revision. After
    the split is cleared, the phase waits (at most ``routers_timeout_s``) until every live
    router has read a table without it, so a failed canary is drained before it is retired."""

    splits: SplitStore
    read_load: Callable[[], dict]
    log: Callable[[str], None]
    revisions: RevisionStore | None = None
    routers: RouterStore | None = None
    routers_timeout_s: float = 30.0
    sleep: Callable[[float], None] = time.sleep
    monotonic: Callable[[], float] = time.monotonic

    def __call__(self, action: Canary) -> CanaryVerdict:
        plan = action.plan
        self._mark(action.revision_id, True)
        self.splits.set(action.endpoint, canary=Share(action.revision_id, plan.percent))
        self.log(f"{action.endpoint}: canary {action.revision_id} takes {plan.percent:g}% for {plan.duration_s:.0f} s")
        canary, serving = Tally(), Tally()
        try:
            end = self.monotonic() + plan.duration_s
            while (left := end - self.monotonic()) > 0:
                self.sleep(min(WINDOW_S, left))
                load = self.read_load().get(action.endpoint)
                if load is None:
                    continue
                canary = canary.add(*load.by_revision.get(action.revision_id, (None, 0, 0)))
                serving = serving.add(*load.by_revision.get(action.serving_revision_id, (None, 0, 0)))
        finally:
            cleared_at = datetime.now(timezone.utc)
            self.splits.forget(action.revision_id)
            self._mark(action.revision_id, False)
        ok, reason = judge(canary, serving, plan.slo_p99_ms, plan.max_error_increase, plan.max_p99_ratio)
        self.log(f"{action.endpoint}: canary {'passed' if ok else 'failed'}: {reason}")
        self._wait_for_routers(cleared_at)
        return CanaryVerdict(ok, reason)

    def _mark(self, revision_id: str, running: bool) -> None:
        if self.revisions is not None:
            self.revisions.add_details(revision_id, canary_phase=running)

    def _wait_for_routers(self, since: datetime) -> None:
        if self.routers is None:
            return
        deadline = self.monotonic() + self.routers_timeout_s
        while self.routers.lagging(since) and self.monotonic() < deadline:
            self.sleep(0.2)
