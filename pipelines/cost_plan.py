"""When to measure a serving version's cost model again: pure decisions for ``cost_model_sensor``.

Two reasons, each stated in the run's tags:

- **missing**: the version serving an endpoint has no profile for the hardware its
  replicas run on (the hardware changed, or the profile was lost). A profile of other
  hardware is never reused: the answer is a benchmark, not a guess.
- **drift**: the router compares every whole (non-streamed) answer's latency with the
  cost model's prediction for its tokens (``modelplane_router_cost_*`` counters). Over a
  window of at least ``min_requests`` answers, observed/predicted outside
  ``1 ± drift_threshold`` means the model no longer describes the replica.

Worked example with the defaults (50 requests, ±50 %): the window holds 80 answers,
observed 96 s against predicted 60 s: ratio 1.6 > 1.5, so ``gec.v3`` is re-measured with
reason "drift: observed latency 1.60× the cost model's over 80 answers".
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_REQUESTS = 50
DRIFT_THRESHOLD = 0.5
RETRY_MISSING_S = 600.0  # a failed benchmark is not re-requested more often than this


@dataclass(frozen=True)
class CostCounters:
    """Cumulative router counters of one endpoint: answers checked, seconds observed, seconds predicted."""

    requests: float
    observed_s: float
    predicted_s: float

    def minus(self, earlier: CostCounters | None) -> CostCounters:
        if earlier is None or self.requests < earlier.requests:  # the router restarted: counters began again
            return self
        return CostCounters(self.requests - earlier.requests, self.observed_s - earlier.observed_s,
                            self.predicted_s - earlier.predicted_s)


@dataclass(frozen=True)
class Remeasure:
    partition_key: str
    reason: str


def decide(serving: dict[str, str], profiled: set[str], hardware: str, counters: dict[str, CostCounters],
           window_start: dict[str, CostCounters], requested_missing: dict[str, float], now_s: float,
           min_requests: int = MIN_REQUESTS, drift_threshold: float = DRIFT_THRESHOLD,
           ) -> tuple[list[Remeasure], dict[str, CostCounters], dict[str, float]]:
    """(what to re-measure, the new window starts, when each missing profile was requested).

    ``serving``: endpoint → partition key of its serving revision; ``profiled``: partition
    keys with a profile on ``hardware``; ``counters``: the router's cumulative counters now.
    """
    decisions: dict[str, Remeasure] = {}
    starts = dict(window_start)
    asked = dict(requested_missing)
    for endpoint, key in sorted(serving.items()):
        if key not in profiled:
            if now_s - asked.get(key, float("-inf")) >= RETRY_MISSING_S:
                decisions.setdefault(key, Remeasure(key, f"missing: no cost profile for {hardware}"))
                asked[key] = now_s
            continue
        now = counters.get(endpoint)
        if now is None:
            continue
        window = now.minus(starts.get(endpoint))
        if window.requests < min_requests or window.predicted_s <= 0:
            starts.setdefault(endpoint, now)
            continue
        ratio = window.observed_s / window.predicted_s
        starts[endpoint] = now  # the next window starts here, whatever was decided
        if abs(ratio - 1) > drift_threshold:
            decisions.setdefault(key, Remeasure(key, f"drift: observed latency {ratio:.2f}× the cost model's "
                                                     f"over {window.requests:.0f} answers"))
    return list(decisions.values()), starts, asked


def parse_router_counters(metrics_text: str) -> dict[str, CostCounters]:
    """The router's ``modelplane_router_cost_*`` counters by endpoint, from its ``/metrics`` text."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, dict[str, float]] = {}
    names = {"modelplane_router_cost_checked_requests": "requests", "modelplane_router_cost_observed_seconds":
             "observed_s", "modelplane_router_cost_predicted_seconds": "predicted_s"}
    for family in text_string_to_metric_families(metrics_text):
        field = names.get(family.name.removesuffix("_total"))
        if field is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                found.setdefault(sample.labels.get("endpoint", "-"), {})[field] = sample.value
    return {endpoint: CostCounters(v.get("requests", 0.0), v.get("observed_s", 0.0), v.get("predicted_s", 0.0))
            for endpoint, v in found.items()}
