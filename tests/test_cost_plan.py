"""When a serving version's cost model is measured again: missing profiles and drift."""

from pipelines.cost_plan import CostCounters, decide, parse_router_counters

HW = "cpu/AMD EPYC/2cpu"


def test_a_serving_version_without_a_profile_for_this_hardware_is_benchmarked_once_per_retry_period():
    decisions, _, asked = decide({"gec": "gec.v3"}, set(), HW, {}, {}, {}, now_s=1000.0)
    assert [(d.partition_key, d.reason) for d in decisions] == [("gec.v3", f"missing: no cost profile for {HW}")]
    again, _, _ = decide({"gec": "gec.v3"}, set(), HW, {}, {}, asked, now_s=1100.0)
    assert again == []
    later, _, _ = decide({"gec": "gec.v3"}, set(), HW, {}, {}, asked, now_s=1700.0)
    assert len(later) == 1


def test_the_worked_example_drift_of_sixty_percent_over_eighty_answers():
    start = {"gec": CostCounters(100, 50.0, 50.0)}
    now = {"gec": CostCounters(180, 146.0, 110.0)}
    decisions, starts, _ = decide({"gec": "gec.v3"}, {"gec.v3"}, HW, now, start, {}, now_s=0.0)
    assert [d.reason for d in decisions] == ["drift: observed latency 1.60× the cost model's over 80 answers"]
    assert starts["gec"] == now["gec"]


def test_small_windows_and_small_deviations_change_nothing():
    start = {"gec": CostCounters(0, 0.0, 0.0)}
    assert decide({"gec": "gec.v3"}, {"gec.v3"}, HW, {"gec": CostCounters(20, 40.0, 10.0)}, start, {}, 0.0)[0] == []
    decisions, starts, _ = decide({"gec": "gec.v3"}, {"gec.v3"}, HW, {"gec": CostCounters(60, 66.0, 60.0)}, start,
                                  {}, 0.0)
    assert decisions == [] and starts["gec"].requests == 60


def test_a_restarted_router_starts_a_new_window():
    start = {"gec": CostCounters(500, 500.0, 500.0)}
    decisions, _, _ = decide({"gec": "gec.v3"}, {"gec.v3"}, HW, {"gec": CostCounters(60, 120.0, 60.0)}, start, {}, 0.0)
    assert [d.partition_key for d in decisions] == ["gec.v3"]


def test_counters_are_read_from_the_routers_metrics_text():
    text = ('# TYPE modelplane_router_cost_checked_requests counter\n'
            'modelplane_router_cost_checked_requests_total{endpoint="gec"} 3.0\n'
            '# TYPE modelplane_router_cost_observed_seconds counter\n'
            'modelplane_router_cost_observed_seconds_total{endpoint="gec"} 1.5\n'
            '# TYPE modelplane_router_cost_predicted_seconds counter\n'
            'modelplane_router_cost_predicted_seconds_total{endpoint="gec"} 1.25\n')
    assert parse_router_counters(text) == {"gec": CostCounters(3.0, 1.5, 1.25)}
