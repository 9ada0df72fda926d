"""What ``benchmarks/autoscale_local.py`` measured, turned into figures and judged: pure functions.

The scenarios hand in answers (:class:`~benchmarks.autoscale_harness.Answer`) and per-repeat
dicts; these functions cut windows, take ratios, summarise repeats (min / median / max) and
say which check of the goal held, so that ``tests/test_autoscale_benchmark.py`` can check
them with no process and no clock.
"""

from __future__ import annotations

from benchmarks.autoscale_harness import Answer
from benchmarks.loadgen import LoadResult
from benchmarks.repeats import spread

CONTROLLER_SAMPLE_S = 1.0  # the controller samples in-flight work this often

def window(answers: list[Answer], start_s: float, end_s: float) -> dict:
    """Requests sent in ``[start_s, end_s)``: count, failures (any status but 200), nearest-rank
    p50/p99 of the answered ones.

    >>> window([Answer(0.5, 200, 0.8), Answer(1.0, 200, 0.2), Answer(1.5, 503, 0.0), Answer(9.0, 200, 5.0)], 0, 2)
    {'requests': 3, 'failed': 1, 'p50_ms': 200.0, 'p99_ms': 800.0}
    """
    inside = [a for a in answers if start_s <= a.sent_s < end_s]
    answered = [a.latency_s for a in inside if a.status == 200]
    ok = LoadResult(concurrency=0, duration_s=end_s - start_s, latencies_s=answered)
    nan_to_none = (lambda v: None if v != v else round(v, 1))
    return {"requests": len(inside), "failed": sum(a.status != 200 for a in inside),
            "p50_ms": nan_to_none(ok.percentile_ms(0.5)), "p99_ms": nan_to_none(ok.percentile_ms(0.99))}


def ratio(anchor_ms: float | None, ours_ms: float | None) -> float:
    """Anchor over ours; 0 when either side measured nothing (never infinite).

    >>> ratio(800.0, 200.0), ratio(800.0, None), ratio(None, 200.0)
    (4.0, 0.0, 0.0)
    """
    return round(anchor_ms / ours_ms, 3) if anchor_ms and ours_ms else 0.0


def settled_at(changes: list[tuple[float, float]], start_s: float, now_s: float, stable_s: float) -> float | None:
    """When the target had gone ``stable_s`` without a change (``changes``: (at, target)), or None yet.

    >>> settled_at([(40.0, 4.5), (70.0, 2.5)], start_s=0.0, now_s=130.0, stable_s=60.0)
    130.0
    >>> settled_at([(40.0, 4.5), (70.0, 2.5)], start_s=0.0, now_s=120.0, stable_s=60.0) is None
    True
    """
    last = max([start_s] + [at for at, _ in changes])
    return last + stable_s if now_s >= last + stable_s else None


def median_of(figures: dict | None) -> float | None:
    """The median of a min/median/max spread, None when nothing was measured."""
    return figures["median"] if figures else None


def judge(step: dict, zero: dict, vertical: dict, lookback_s: float) -> dict[str, dict]:
    """Each check of the goal: ``{"ok": bool, "detail": "the figures against the bar"}``.

    ``step``, ``zero``, ``vertical`` are the scenarios' ``summary`` parts (min/median/max
    spreads); a scenario that failed to run has ``{"error": ...}`` and fails its checks.
    """
    def check(ok: bool, detail: str) -> dict:
        return {"ok": bool(ok), "detail": detail}

    def missing(part: dict) -> dict:
        return check(False, f"not measured: {part.get('error', 'no figures')}")

    checks: dict[str, dict] = {}
    if "error" in step or not step:
        for name in ("step_p99_not_worse", "scaled_p99_2x", "added_replicas_take_traffic_30s",
                     "scale_down_after_lookback", "no_failed_request"):
            checks[name] = missing(step)
    else:
        r_step, r_scaled = median_of(step["p99_ratio_step"]), median_of(step["p99_ratio_scaled"])
        traffic = median_of(step.get("time_to_first_added_traffic_s"))
        earliest = (step.get("drop_to_scale_down_decision_s") or {}).get("min")
        checks["step_p99_not_worse"] = check(r_step >= 0.9, f"anchor p99 / ours p99 in the step window: median "
                                             f"{r_step} (≥ 0.9)")
        checks["scaled_p99_2x"] = check(r_scaled >= 2.0, f"anchor p99 / ours p99 once scaled: median {r_scaled} (≥ 2)")
        without = step.get("repeats_without_added_traffic", 0)
        checks["added_replicas_take_traffic_30s"] = check(
            traffic is not None and traffic <= 30.0 and not without,
            f"step → an added replica's first request: median {traffic} s (≤ 30 s); {without} repeat(s) without")
        checks["scale_down_after_lookback"] = check(
            earliest is not None and earliest >= lookback_s - CONTROLLER_SAMPLE_S,
            f"drop → scale-down decision: earliest {earliest} s (≥ lookback {lookback_s:g} s − 1 s sample)")
        failed = step["failed_requests_ours"] + step["failed_requests_anchor"]
        checks["no_failed_request"] = check(failed == 0, f"{step['failed_requests_ours']} failed on ours, "
                                            f"{step['failed_requests_anchor']} on the anchor (0)")
    if "error" in zero or not zero:
        checks["from_zero_served"] = checks["from_zero_within_cold_start_3s"] = missing(zero)
    else:
        overhead = (zero["overhead_s"] or {}).get("max")
        checks["from_zero_served"] = check(zero["failed"] == 0, f"{zero['failed']} of {zero['requests']} "
                                           "requests from zero failed (0)")
        checks["from_zero_within_cold_start_3s"] = check(overhead is not None and overhead <= 3.0,
                                                         f"latency − cold start: worst {overhead} s (≤ 3 s)")
    if "error" in vertical or not vertical:
        checks["vertical_settles_within_bounds"] = checks["vertical_p99_within_slo"] = missing(vertical)
    else:
        low, high = vertical["bounds"]
        final, p99 = vertical["final_target"], vertical["after_settling"]["p99_ms"]
        checks["vertical_settles_within_bounds"] = check(
            vertical["settled"] and low <= final <= high,
            f"target {vertical['initial_target']} → {final}, settled: {vertical['settled']} "
            f"(bounds [{low:g}, {high:g}])")
        checks["vertical_p99_within_slo"] = check(p99 is not None and p99 <= vertical["slo_p99_ms"],
                                                  f"p99 after settling {p99} ms (SLO {vertical['slo_p99_ms']:g} ms)")
    return checks


def summarise_step(repeats: list[dict]) -> dict:
    """min/median/max over the repeats of every figure that moves between runs."""
    def over(key: str, part: str | None = None) -> dict | None:
        values = [(r[part] if part else r)[key] for r in repeats]
        values = [v for v in values if v is not None]
        return spread(values) if values else None

    return {"p99_ratio_step": over("p99_ratio_step"), "p50_ratio_step": over("p50_ratio_step"),
            "p99_ratio_scaled": over("p99_ratio_scaled"),
            "ours_p99_step_ms": spread([r["ours_step"]["p99_ms"] or 0.0 for r in repeats]),
            "anchor_p99_step_ms": spread([r["anchor_step"]["p99_ms"] or 0.0 for r in repeats]),
            "ours_p99_scaled_ms": spread([r["ours_scaled"]["p99_ms"] or 0.0 for r in repeats]),
            "anchor_p99_scaled_ms": spread([r["anchor_scaled"]["p99_ms"] or 0.0 for r in repeats]),
            "time_to_first_decision_s": over("time_to_first_decision_s"),
            "time_to_first_added_ready_s": over("time_to_first_added_ready_s"),
            "time_to_all_ready_s": over("time_to_all_ready_s"),
            "time_to_first_added_traffic_s": over("time_to_first_added_traffic_s"),
            "time_to_all_added_traffic_s": over("time_to_all_added_traffic_s"),
            "drop_to_scale_down_decision_s": over("drop_to_scale_down_decision_s", "idle"),
            "failed_requests_ours": sum(r["failed_requests_ours"] for r in repeats),
            "failed_requests_anchor": sum(r["failed_requests_anchor"] for r in repeats),
            "repeats_without_added_traffic": sum(r["time_to_first_added_traffic_s"] is None for r in repeats),
            "repeats": len(repeats)}


def summarise_zero(repeats: list[dict]) -> dict:
    """Requests from zero: how many failed, and min/median/max of latency, cold start and their difference.

    >>> summarise_zero([{"status": 200, "latency_s": 3.2, "cold_start_s": 3.0, "overhead_s": 0.2,
    ...                  "latency_over_cold_start": 1.067}])["overhead_s"]
    {'min': 0.2, 'median': 0.2, 'max': 0.2, 'n': 1}
    """
    return {"requests": len(repeats), "failed": sum(r["status"] != 200 for r in repeats),
            **{key: spread([r[key] for r in repeats])
               for key in ("latency_s", "cold_start_s", "overhead_s", "latency_over_cold_start")}}
