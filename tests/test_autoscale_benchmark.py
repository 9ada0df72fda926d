"""How benchmarks/autoscale_local.py turns what it measured into figures and a verdict
(no processes, no timings: the scenarios themselves run only in the benchmark)."""

import pytest

from benchmarks.autoscale_harness import Answer
from benchmarks.autoscale_figures import judge, ratio, settled_at, summarise_step, window
from benchmarks.autoscale_local import FULL, QUICK, notes


def spread_of(value: float) -> dict:
    return {"min": value, "median": value, "max": value, "n": 1}


def step_summary(**changes) -> dict:
    summary = {"p99_ratio_step": spread_of(1.0), "p99_ratio_scaled": spread_of(3.5),
               "time_to_first_added_traffic_s": spread_of(12.0), "drop_to_scale_down_decision_s": spread_of(30.4),
               "failed_requests_ours": 0, "failed_requests_anchor": 0}
    return summary | changes


ZERO = {"requests": 3, "failed": 0, "overhead_s": {"min": 0.6, "median": 0.9, "max": 1.4, "n": 3}}
VERTICAL = {"bounds": [1.0, 8.0], "initial_target": 8, "final_target": 2.53, "settled": True, "slo_p99_ms": 450.0,
            "after_settling": {"p99_ms": 230.0}}


def test_a_window_holds_the_requests_sent_in_it_and_counts_every_status_but_200_as_failed():
    answers = [Answer(9.9, 200, 5.0), Answer(10.0, 200, 0.8), Answer(10.5, 502, 0.0), Answer(11.0, 0, 2.0),
               Answer(12.0, 200, 0.2)]
    assert window(answers, 10.0, 12.0) == {"requests": 3, "failed": 2, "p50_ms": 800.0, "p99_ms": 800.0}
    assert window(answers, 20.0, 30.0) == {"requests": 0, "failed": 0, "p50_ms": None, "p99_ms": None}


@pytest.mark.parametrize("anchor, ours, expected", [(800.0, 200.0, 4.0), (800.0, 800.0, 1.0), (800.0, None, 0.0),
                                                    (None, 200.0, 0.0), (0.0, 0.0, 0.0)])
def test_a_ratio_is_anchor_over_ours_and_never_infinite(anchor, ours, expected):
    assert ratio(anchor, ours) == expected


@pytest.mark.parametrize("changes, now_s, expected", [
    ([], 64.0, None),                             # no change yet, not stable long enough
    ([], 65.0, 65.0),                             # never changed: settled once stable_s passed since the start
    ([(30.0, 4.5), (60.0, 2.5)], 124.0, None),    # the last change is only 64 s old
    ([(30.0, 4.5), (60.0, 2.5)], 125.0, 125.0),
])
def test_the_target_has_settled_once_it_went_stable_s_without_a_change(changes, now_s, expected):
    assert settled_at(changes, start_s=0.0, now_s=now_s, stable_s=65.0) == expected


def test_every_check_holds_when_every_figure_meets_its_bar():
    checks = judge(step_summary(), ZERO, VERTICAL, lookback_s=30.0)
    assert all(check["ok"] for check in checks.values()), checks
    assert set(checks) == {"step_p99_not_worse", "scaled_p99_2x", "added_replicas_take_traffic_30s",
                           "scale_down_after_lookback", "no_failed_request", "from_zero_served",
                           "from_zero_within_cold_start_3s", "vertical_settles_within_bounds",
                           "vertical_p99_within_slo"}


@pytest.mark.parametrize("step, zero, vertical, failing", [
    (step_summary(p99_ratio_step=spread_of(0.85)), ZERO, VERTICAL, "step_p99_not_worse"),
    (step_summary(p99_ratio_scaled=spread_of(1.9)), ZERO, VERTICAL, "scaled_p99_2x"),
    (step_summary(time_to_first_added_traffic_s=None), ZERO, VERTICAL, "added_replicas_take_traffic_30s"),
    (step_summary(time_to_first_added_traffic_s=spread_of(31.0)), ZERO, VERTICAL, "added_replicas_take_traffic_30s"),
    (step_summary(repeats_without_added_traffic=1), ZERO, VERTICAL, "added_replicas_take_traffic_30s"),
    (step_summary(drop_to_scale_down_decision_s={"min": 28.5, "median": 30.2, "max": 30.9, "n": 3}), ZERO, VERTICAL,
     "scale_down_after_lookback"),                # one repeat scaled down 1.5 s before the 30 s lookback
    (step_summary(failed_requests_ours=1), ZERO, VERTICAL, "no_failed_request"),
    (step_summary(), ZERO | {"failed": 1}, VERTICAL, "from_zero_served"),
    (step_summary(), ZERO | {"overhead_s": {"min": 0.5, "median": 1.0, "max": 3.2, "n": 3}}, VERTICAL,
     "from_zero_within_cold_start_3s"),
    (step_summary(), ZERO, VERTICAL | {"settled": False}, "vertical_settles_within_bounds"),
    (step_summary(), ZERO, VERTICAL | {"after_settling": {"p99_ms": 460.0}}, "vertical_p99_within_slo"),
    (step_summary(), ZERO, VERTICAL | {"after_settling": {"p99_ms": None}}, "vertical_p99_within_slo"),
])
def test_each_check_fails_on_its_own_figure(step, zero, vertical, failing):
    checks = judge(step, zero, vertical, lookback_s=30.0)
    assert [name for name, check in checks.items() if not check["ok"]] == [failing]


def test_a_scenario_that_did_not_run_fails_its_checks_and_says_why():
    checks = judge({"error": "AssertionError: timed out after 90 s waiting for scale to zero"}, ZERO, VERTICAL, 30.0)
    failed = {name: check["detail"] for name, check in checks.items() if not check["ok"]}
    assert len(failed) == 5 and all("timed out" in detail for detail in failed.values())


def test_the_step_summary_gives_min_median_max_over_the_repeats_and_sums_the_failures():
    def repeat(ratio_step: float, traffic_s: float | None, failed: int) -> dict:
        p99 = {"p99_ms": 800.0}
        return {"p99_ratio_step": ratio_step, "p50_ratio_step": 3.0, "p99_ratio_scaled": 3.5, "ours_step": p99,
                "anchor_step": p99, "ours_scaled": p99, "anchor_scaled": p99, "time_to_first_decision_s": 2.0,
                "time_to_first_added_ready_s": 9.0, "time_to_all_ready_s": 11.0,
                "time_to_first_added_traffic_s": traffic_s, "time_to_all_added_traffic_s": traffic_s,
                "idle": {"drop_to_scale_down_decision_s": 30.5}, "failed_requests_ours": failed,
                "failed_requests_anchor": 0}

    summary = summarise_step([repeat(0.98, 10.0, 0), repeat(1.0, None, 2), repeat(1.02, 12.0, 0)])
    assert summary["p99_ratio_step"] == {"min": 0.98, "median": 1.0, "max": 1.02, "n": 3}
    assert summary["time_to_first_added_traffic_s"]["n"] == 2  # a repeat that saw no traffic is left out, not 0
    assert summary["repeats_without_added_traffic"] == 1  # ... and counted, so the check fails
    assert summary["failed_requests_ours"] == 2 and summary["repeats"] == 3


def test_the_quick_run_says_which_shortcuts_it_took():
    assert any("--quick" in note for note in notes(QUICK, quick=True))
    assert not any("--quick" in note for note in notes(FULL, quick=False))
    assert any("300 s" in note for note in notes(FULL, quick=False))  # the shortened lookback, always
