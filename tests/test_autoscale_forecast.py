"""The predictive floor: yesterday's demand one cold start ahead, scaled by today's level."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoscale.forecast import DemandHistory, apply_floor, forecast_peak, predictive_floor
from autoscale.horizontal import Decision

MINUTE = 60.0
NOW_MINUTE = 8 * 1440  # "now" is 8 days in: room for a week-old window and the 8-day retention
NOW_S = NOW_MINUTE * MINUTE


def history(by_minute: dict[int, float], days: int = 1, base: float = 10.0, recent: float | None = None,
            week: dict[int, float] | None = None) -> DemandHistory:
    """``base`` in flight each minute of the last ``days`` days up to now, except ``by_minute``
    (offsets from now minus a day) and ``week`` (offsets from now minus a week); the last 10 minutes
    at ``recent`` (default ``base``)."""
    demand = DemandHistory()
    for minute in range(NOW_MINUTE - days * 1440 - 20, NOW_MINUTE):
        value = base
        if week and minute - (NOW_MINUTE - 7 * 1440) in week:
            value = week[minute - (NOW_MINUTE - 7 * 1440)]
        if minute - (NOW_MINUTE - 1440) in by_minute:
            value = by_minute[minute - (NOW_MINUTE - 1440)]
        if recent is not None and minute >= NOW_MINUTE - 10:
            value = recent
        demand.add(minute * MINUTE + 5, value)
    return demand


CASES = {
    # name: (history, horizon_s, expected forecast)
    "a flat day forecasts yesterday's level": (history({}), 120, 10.0),
    "a ramp within the horizon is seen ahead of time": (history({1: 20, 2: 40}), 120, 40.0),
    "a ramp beyond the horizon is not": (history({3: 40}), 120, 10.0),
    "the horizon is the cold start: a longer one sees further": (history({3: 40}), 180, 40.0),
    "a busier day than yesterday scales the forecast: 40 × 12 / 10":
        (history({1: 40}, recent=12.0), 120, 48.0),
    "the level ratio is clamped to 2": (history({1: 40}, recent=100.0), 120, 80.0),
    "the level ratio is clamped to 0.5": (history({1: 40}, recent=1.0), 120, 20.0),
    "a week ago's higher peak wins when held": (history({1: 40}, days=7, week={2: 60}), 120, 60.0),
    "a week ago's lower peak does not": (history({1: 40}, days=7, week={2: 30}), 120, 40.0),
}


@pytest.mark.parametrize("demand, horizon_s, expected", CASES.values(), ids=CASES.keys())
def test_forecast_table(demand, horizon_s, expected):
    assert forecast_peak(demand, NOW_S, horizon_s) == pytest.approx(expected)


def test_no_forecast_without_day_old_history():
    demand = DemandHistory()
    for minute in range(NOW_MINUTE - 600, NOW_MINUTE):  # ten hours only
        demand.add(minute * MINUTE, 10.0)
    assert forecast_peak(demand, NOW_S, 120) is None
    assert predictive_floor(demand, NOW_S, 120, target=4, max_replicas=10) == \
        (0, "no demand history from a day ago: no predictive floor")


def test_history_keeps_the_per_minute_peak_for_eight_days():
    demand = DemandHistory()
    for second in range(0, 9 * 86_400, 30):
        demand.add(float(second), 1.0 + (second // 30) % 2)
    minutes = list(demand.peak_by_minute)
    assert minutes[-1] == 9 * 1440 - 1 and minutes[0] == minutes[-1] - 8 * 1440
    assert set(demand.peak_by_minute.values()) == {2.0}


def test_a_late_sample_updates_its_minute_if_held_and_is_dropped_otherwise():
    demand = DemandHistory()
    demand.add(60.0, 3.0)
    demand.add(130.0, 1.0)
    demand.add(70.0, 9.0)  # minute 1, held
    demand.add(10.0, 9.0)  # minute 0, never held
    assert dict(demand.peak_by_minute) == {1: 9.0, 2: 1.0}


def test_predictive_floor_reads_the_forecast_in_replicas():
    floor, reason = predictive_floor(history({1: 40}, recent=12.0), NOW_S, 120, target=4, max_replicas=20)
    assert floor == 12
    assert reason == ("a day ago the next 120 s peaked at 40.0 in flight and the last 10 min ran 1.20× the same "
                      "minutes a day ago: forecast 48.0 / target 4 = 12 replicas")


def test_predictive_floor_is_capped_at_max_replicas():
    floor, reason = predictive_floor(history({1: 40}, recent=12.0), NOW_S, 120, target=4, max_replicas=10)
    assert floor == 10 and reason.endswith("capped at max_replicas 10")


def test_a_winning_floor_names_itself_and_keeps_the_reactive_reason():
    reactive = Decision(3, "hold", "holding 3 replicas", {"target": 4})
    floored = apply_floor(reactive, 12, "forecast 48.0 / target 4 = 12 replicas")
    assert (floored.replicas, floored.rule) == (12, "predictive-floor")
    assert floored.reason == "forecast 48.0 / target 4 = 12 replicas (the reactive policy wanted 3: holding 3 replicas)"
    assert floored.inputs == {"target": 4, "predictive_floor": 12, "reactive_replicas": 3, "reactive_rule": "hold"}


def test_a_losing_floor_leaves_the_decision_alone():
    reactive = Decision(12, "scale-up", "in flight 48.0 / target 4 = 12 replicas", {})
    kept = apply_floor(reactive, 5, "forecast 20.0")
    assert (kept.replicas, kept.rule, kept.reason) == (12, "scale-up", reactive.reason)


@given(st.integers(0, 500), st.integers(0, 500), st.sampled_from(["hold", "scale-down", "scale-to-zero", "min"]))
def test_the_floor_never_lowers_a_reactive_decision(reactive_replicas, floor, rule):
    decided = apply_floor(Decision(reactive_replicas, rule, "reactive", {}), floor, "floor")
    assert decided.replicas == max(reactive_replicas, floor)
