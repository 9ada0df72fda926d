"""benchmarks/autoscale_day judges each goal from the day's rows and the routing results (pure functions)."""

from benchmarks.autoscale_day import OURS, judge_day, judge_routing


def row(policy, hours, within, **extra):
    return {"policy": policy, "replica_hours": hours, "within_slo": within, "saving_vs_static_peak": 1 - hours / 1000,
            "x_oracle": hours / 150, "reversals_5min": 0, "reversals_5min_steady": 0,
            "time_to_capacity_after_ramp_s": 100.0, **extra}


def test_ours_passes_only_with_fewer_hours_and_at_least_the_anchors_slo():
    rows = {OURS: row(OURS, 180, 0.99995), "hpa": row("hpa", 200, 0.9999), "knative_kpa": row("knative_kpa", 170, 0.9)}
    checks = judge_day(rows, cold_start_median_s=60.0)
    assert checks["saving_and_slo"]["ok"]  # 82 % saved, 99.995 % within
    assert checks["x_oracle"]["ok"]  # 180 / 150 = 1.2
    assert checks["ramp"]["ok"]  # 100 s after the ramp is 40 s beyond a 60 s cold start
    assert checks["vs_hpa"]["ok"]
    assert not checks["vs_knative_kpa"]["ok"]  # fewer hours than ours, even at a worse SLO
    assert "1.06× its replica-hours" in checks["vs_knative_kpa"]["detail"]


def test_a_late_ramp_a_steady_reversal_and_a_missed_slo_each_fail_their_goal():
    rows = {OURS: row(OURS, 180, 0.999, time_to_capacity_after_ramp_s=None, reversals_5min_steady=1)}
    checks = judge_day(rows, cold_start_median_s=60.0)
    assert not checks["saving_and_slo"]["ok"] and not checks["ramp"]["ok"] and not checks["steady_reversals"]["ok"]
    assert checks["ramp"]["detail"] == "never reached capacity"


def test_routing_goal_holds_at_every_load_and_replica_count_or_fails_naming_the_one_that_missed():
    def result(balancer, p99, replicas=64, load=0.8):
        return {"balancer": balancer, "p99_ms": p99, "replicas": replicas, "load_factor": load}

    good = [result("p2c_units", 10), result("round_robin", 30), result("least_loaded", 10)]
    bad = [result("p2c_units", 10, 512), result("round_robin", 12, 512), result("least_loaded", 8, 512)]
    checks = judge_routing(good + bad)
    assert checks["routing_64_at_0.8"]["ok"]
    assert not checks["routing_512_at_0.8"]["ok"]
    assert checks["routing_512_at_0.8"]["detail"] == "p2c_units p99 0.83× round robin, 1.25× least loaded"
