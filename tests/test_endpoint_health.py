"""The endpoint_health verdict: every problem named with its numbers, and when a bake fails."""

from __future__ import annotations

from dataclasses import replace

import pytest

from assets.endpoint_health import HealthInputs, HealthThresholds, assess

HEALTHY = HealthInputs(endpoint="gec", revision_id="gec-v2-aa", slo_p99_ms=1000.0, p99_latency_ms=400.0, requests=500,
                       errors=0, ready_replicas=2, desired_replicas=2, router_heartbeat_age_s=0.5,
                       autoscaler_heartbeat_age_s=1.0, serving_for_s=3600.0)


def test_a_healthy_endpoint_passes_with_no_problem():
    report = assess(HEALTHY)
    assert report.passed and report.problems == () and report.rollback_reason is None
    assert report.describe() == "healthy"


@pytest.mark.parametrize("change, problem", [
    ({"p99_latency_ms": 1200.0}, "p99 1200 ms is above the SLO of 1000 ms"),
    ({"errors": 10}, "2.0% of 500 answers failed (at most 1.0%)"),
    ({"ready_replicas": 1}, "1 of 2 replicas ready"),
    ({"router_heartbeat_age_s": 45.0}, "the router last reported 45 s ago (stale after 30 s)"),
    ({"router_heartbeat_age_s": None}, "no router has reported"),
    ({"autoscaler_heartbeat_age_s": 31.0}, "the autoscaler last reported 31 s ago (stale after 30 s)"),
    ({"autoscaler_heartbeat_age_s": None}, "no autoscaler has reported"),
])
def test_each_problem_fails_the_check_and_is_named(change, problem):
    report = assess(replace(HEALTHY, **change))
    assert not report.passed and report.problems == (problem,)
    assert report.rollback_reason is None  # an old revision is not rolled back: there is nothing newer to blame


def test_a_rate_over_too_few_answers_says_nothing():
    assert assess(replace(HEALTHY, requests=19, errors=19)).passed


@pytest.mark.parametrize("change, rollback", [
    ({"errors": 100}, "20.0% failed answers in its first 60 s (bake allows 5.0%)"),
    ({"p99_latency_ms": 2500.0}, "p99 2500 ms in its first 60 s, above 2 × the SLO of 1000 ms"),
    ({"errors": 20}, None),  # 4 %: fails the check, within the bake's 5 %
    ({"p99_latency_ms": 1500.0}, None),  # a slow start: above the SLO, under 2 × it
])
def test_a_new_revision_is_rolled_back_only_when_it_breaks_a_bake_rule(change, rollback):
    report = assess(replace(HEALTHY, serving_for_s=60.0, **change))
    assert not report.passed and report.rollback_reason == rollback


def test_a_new_revision_is_not_judged_on_too_few_answers():
    report = assess(replace(HEALTHY, serving_for_s=60.0, requests=10, errors=5))
    assert report.passed and report.rollback_reason is None


def test_after_the_bake_window_nothing_is_rolled_back():
    report = assess(replace(HEALTHY, serving_for_s=601.0, errors=250))
    assert not report.passed and report.rollback_reason is None
    assert assess(replace(HEALTHY, serving_for_s=601.0, errors=250),
                  HealthThresholds(bake_window_s=900.0)).rollback_reason is not None
