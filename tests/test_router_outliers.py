"""Outlier ejection: Envoy's consecutive-failure rule, its backoff, and the bound on how many are out."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.router.outliers import EjectionConfig, OutlierDetector

TWO = ("a", "b")
TEN = tuple("abcdefghij")


def fail(detector: OutlierDetector, url: str, replicas, now: float, times: int) -> list[bool]:
    return [detector.failure(url, replicas, now) for _ in range(times)]


@pytest.mark.parametrize("events, now, expected", [
    # events: (url, "fail"/"ok", count, at); replicas: a and b
    ([("a", "fail", 5, 0.0)], 0.0, {"a"}),
    ([("a", "fail", 4, 0.0)], 0.0, set()),
    ([("a", "fail", 4, 0.0), ("a", "ok", 1, 0.0), ("a", "fail", 4, 0.0)], 0.0, set()),  # a success resets
    ([("a", "fail", 4, 0.0), ("a", "ok", 1, 0.0), ("a", "fail", 5, 0.0)], 0.0, {"a"}),
    ([("a", "fail", 4, 0.0), ("b", "fail", 4, 0.0), ("a", "fail", 1, 0.0)], 0.0, {"a"}),  # counts are per replica
    ([("a", "fail", 5, 0.0), ("b", "fail", 5, 1.0)], 1.0, {"a"}),  # never both of two
    ([("a", "fail", 5, 0.0), ("b", "fail", 5, 30.0)], 30.0, {"b"}),  # a is back: b may go
    # ... also for a replica ejected before (which the detector keeps a record of)
    ([("a", "fail", 5, 0.0), ("a", "fail", 4, 30.0), ("a", "ok", 1, 31.0), ("a", "fail", 4, 31.0)], 31.0, set()),
    ([("a", "fail", 5, 0.0)], 29.999, {"a"}),
    ([("a", "fail", 5, 0.0)], 30.0, set()),  # back after exactly base × 1
])
def test_the_nth_consecutive_failure_ejects_within_the_bound(events, now, expected):
    detector = OutlierDetector(EjectionConfig())
    for url, kind, count, at in events:
        for _ in range(count):
            detector.failure(url, TWO, at) if kind == "fail" else detector.success(url, at)
    assert detector.ejected(now) == expected


@pytest.mark.parametrize("replica_count, max_ejected_percent, most_ejected", [
    (1, 10.0, 0),  # a lone replica is never ejected
    (2, 10.0, 1),  # at least one of two or more, whatever the percentage
    (10, 10.0, 1),
    (20, 10.0, 2),
    (35, 10.0, 3),
    (4, 50.0, 2),
    (3, 100.0, 2),  # never all
    (5, 0.0, 1),
])
def test_at_most_the_percentage_and_never_all_are_ejected(replica_count, max_ejected_percent, most_ejected):
    replicas = tuple(f"r{i}" for i in range(replica_count))
    detector = OutlierDetector(EjectionConfig(max_ejected_percent=max_ejected_percent))
    ejections = [fail(detector, url, replicas, 0.0, 5)[-1] for url in replicas]
    assert sum(ejections) == most_ejected == len(detector.ejected(0.0))


def test_failures_while_ejected_do_not_count_and_a_refused_ejection_restarts_the_count():
    detector = OutlierDetector(EjectionConfig())
    assert fail(detector, "a", TWO, 0.0, 5)[-1]
    assert fail(detector, "a", TWO, 1.0, 7) == [False] * 7  # answers to requests sent before it went out
    assert not any(fail(detector, "b", TWO, 1.0, 5))  # refused: a is out
    assert detector.status(1.0, ["b"])[1]["consecutive_failures"] == 0  # as Envoy: the count starts again
    assert detector.ejected(30.0) == frozenset()
    assert fail(detector, "a", TWO, 30.0, 5) == [False, False, False, False, True]  # nothing was kept


@pytest.mark.parametrize("back_for_s, next_ejection_s", [
    (0.0, 60.0),  # ejected again at once: the 2nd ejection, 2 × 30 s
    (9.9, 60.0),
    (10.0, 30.0),  # one interval back in rotation takes one ejection off
    (25.0, 30.0),  # never below the first
])
def test_each_ejection_lasts_longer_and_time_back_in_rotation_forgives(back_for_s, next_ejection_s):
    detector = OutlierDetector(EjectionConfig())
    assert fail(detector, "a", TEN, 0.0, 5)[-1]
    back_s = 30.0 + back_for_s
    assert fail(detector, "a", TEN, back_s, 5)[-1]
    assert "a" in detector.ejected(back_s + next_ejection_s - 1e-6)
    assert "a" not in detector.ejected(back_s + next_ejection_s)


def test_ejections_grow_to_base_times_k_then_stop_at_the_cap():
    detector, now, lasted = OutlierDetector(EjectionConfig(base_ejection_s=70.0, max_ejection_s=300.0)), 0.0, []
    for _ in range(6):
        assert fail(detector, "a", TWO, now, 5)[-1]
        row = detector.status(now)[0]
        lasted.append(row["ejected_remaining_s"])
        now += row["ejected_remaining_s"]
    assert lasted == [70.0, 140.0, 210.0, 280.0, 300.0, 300.0]  # k stopped at 5: 5 × 70 s passes the cap
    assert detector.status(now + 40.0)[0]["times_ejected"] == 1  # 4 intervals of 10 s back: 5 → 1


def test_status_reports_each_replica_for_metrics_and_the_cli():
    detector = OutlierDetector(EjectionConfig())
    fail(detector, "a", TWO, 0.0, 5)
    fail(detector, "b", TWO, 0.0, 2)
    assert detector.status(12.5, ["a", "b", "c"]) == [
        {"url": "a", "ejected": True, "ejected_remaining_s": 17.5, "times_ejected": 1, "consecutive_failures": 0},
        {"url": "b", "ejected": False, "ejected_remaining_s": 0.0, "times_ejected": 0, "consecutive_failures": 2},
        {"url": "c", "ejected": False, "ejected_remaining_s": 0.0, "times_ejected": 0, "consecutive_failures": 0},
    ]


def test_replicas_that_left_the_table_are_forgotten():
    detector = OutlierDetector(EjectionConfig())
    fail(detector, "a", TWO, 0.0, 5)
    fail(detector, "b", TWO, 0.0, 3)
    detector.forget_absent(["b", "c"])
    assert detector.ejected(0.0) == frozenset() and [row["url"] for row in detector.status(0.0)] == ["b"]


def test_a_healthy_replica_costs_no_memory():
    detector = OutlierDetector(EjectionConfig())
    fail(detector, "a", TWO, 0.0, 3)
    detector.success("a", 0.0)
    detector.success("b", 0.0)
    assert detector.status(0.0) == []


# (seconds since the previous event, which replica, failed?): mostly failures, often in the same instant,
# on a few replicas, so that ejections, returns and re-ejections within an interval all happen
events = st.lists(st.tuples(st.one_of(st.just(0.0), st.floats(0, 40)), st.integers(0, 11),
                            st.sampled_from([True, True, True, False])), max_size=120)


@settings(max_examples=300)
@given(replica_count=st.integers(1, 12), max_ejected_percent=st.sampled_from([0.0, 10.0, 25.0, 50.0, 100.0]),
       consecutive_failures=st.integers(1, 5), events=events)
def test_never_all_never_over_the_bound_back_exactly_on_time(replica_count, max_ejected_percent,
                                                              consecutive_failures, events):
    config = EjectionConfig(consecutive_failures=consecutive_failures, max_ejected_percent=max_ejected_percent)
    replicas, detector, now = tuple(f"r{i}" for i in range(replica_count)), OutlierDetector(config), 0.0
    bound = 0 if replica_count == 1 else max(1, math.floor(max_ejected_percent * replica_count / 100))
    k_of, back_since_s = {}, {}  # the spec's multiplier, kept apart from the detector's
    for gap_s, index, failed in events:
        now += gap_s
        url = replicas[index % replica_count]
        if failed:
            if detector.failure(url, replicas, now):
                k = max(0, k_of.get(url, 0) - math.floor((now - back_since_s.get(url, now)) / config.interval_s))
                k_of[url] = k + 1 if config.base_ejection_s * k < config.max_ejection_s else k
                until_s = back_since_s[url] = now + config.base_ejection_s * k_of[url]  # base × k ≤ the cap here
                assert url in copy.deepcopy(detector).ejected(until_s - 1e-6)
                assert url not in copy.deepcopy(detector).ejected(until_s)
        else:
            detector.success(url, now)
            assert all(row["consecutive_failures"] == 0 for row in detector.status(now) if row["url"] == url)
        ejected = detector.ejected(now)
        assert len(ejected) < replica_count  # never all
        assert len(ejected) <= bound
