"""How benchmarks/sim_fidelity.py builds its demand, fits its replicas and compares the two sides
(no processes: the real replay runs only in the benchmark)."""

import math

import numpy as np
import pytest

from autoscale.sim.demand import Trace
from benchmarks.sim_fidelity_figures import (
    QUICK, Timing, compare, count_difference, fidelity_demand, fit_rows_level, percentiles, rows_cost_model,
    rows_for, sim_latencies, step_series, verdict, weighted_percentile)
from costmodel.fit import Coefficients, CostModel
from costmodel.sweep import RequestSample, SweepPoint, nearest_rank_percentile


def cost_model(levels: dict[int, tuple[float, float]]) -> CostModel:
    """A cost model of rows: {concurrency: (α ms per row, γ ms)}."""
    return CostModel(levels={c: Coefficients(a, 0.0, g, c) for c, (a, g) in levels.items()},
                     target_concurrency=min(levels), slo_met=True, slo_message="", r2=math.nan,
                     heldout_median_abs_pct_error=math.nan, n_samples=0, kind="llm", slo_p99_ms=500.0)


def test_rows_map_the_median_prompt_to_one_row_and_clamp_long_ones():
    assert rows_for(np.array([1, 1000, 1001, 2000, 2001, 10**6]), 1000.0).tolist() == [1, 1, 2, 2, 3, 4]
    with pytest.raises(ValueError):
        rows_for(np.array([1]), 0.0)


def test_the_demand_scales_the_trace_steps_up_and_gives_every_request_a_size_and_a_send_time():
    seconds = 200
    arrival = np.repeat(np.arange(seconds, dtype=float), 5) + 0.5  # 5 a second, flat
    trace = Trace(arrival, np.full(len(arrival), 1000), np.full(len(arrival), 100), "flat.csv")
    timing = Timing(duration_s=120, step_at_s=40, step_end_s=80, base_rps=4.0, step_factor=3.0, sweep_s=1.0,
                    lookback_s=10.0)
    demand = fidelity_demand(trace, timing)
    assert len(demand.arrivals) == 120
    assert demand.arrivals[:40].mean() == pytest.approx(4.0, rel=0.2)
    assert demand.arrivals[40:80].mean() == pytest.approx(12.0, rel=0.15)
    assert demand.arrivals[80:].mean() == pytest.approx(4.0, rel=0.2)
    assert len(demand.rows) == len(demand.send_at_s) == demand.arrivals.sum()
    assert (np.floor(demand.send_at_s).astype(int) == np.repeat(np.arange(120), demand.arrivals)).all()
    assert (np.diff(demand.send_at_s) >= 0).all()
    sim = demand.to_sim()
    assert sim.arrivals.tolist() == demand.arrivals.tolist() and sim.input_tokens.tolist() == demand.rows.tolist()
    again = fidelity_demand(trace, timing)
    assert again.arrivals.tolist() == demand.arrivals.tolist()  # seeded


def test_a_step_outside_the_run_is_refused():
    trace = Trace(np.arange(10.0), np.ones(10, int), np.ones(10, int), "t.csv")
    with pytest.raises(ValueError):
        fidelity_demand(trace, Timing(60, 50, 40, 1.0, 2.0, 1.0, 10.0))


def test_a_level_is_fitted_as_alpha_per_row_plus_gamma_and_never_goes_negative():
    samples = [RequestSample(r, 0, 4, 50.0 * r + 150.0, None, True) for r in (1, 2, 3, 4)]
    samples.append(RequestSample(1, 0, 4, 99999.0, None, False))  # failed: left out
    level = fit_rows_level(samples, 4)
    assert (level.alpha_ms_per_input_token, level.gamma_ms) == pytest.approx((50.0, 150.0))
    assert level.beta_ms_per_output_token == 0.0
    falling = [RequestSample(r, 0, 1, 100.0 - 20.0 * r, None, True) for r in (1, 2, 3)]
    assert fit_rows_level(falling, 1).alpha_ms_per_input_token == 0.0
    assert fit_rows_level([RequestSample(2, 0, 1, 80.0, None, True)], 1).gamma_ms == 80.0


def test_the_cost_model_has_a_level_per_swept_concurrency_and_a_target_that_holds_the_slo():
    samples = [RequestSample(r, 0, c, 50.0 * r * c, None, True) for c in (1, 2, 4) for r in (1, 2, 3, 4)]
    points = [SweepPoint.aggregate([s for s in samples if s.concurrency == c and s.input_tokens == r], 1.0)
              for c in (1, 2, 4) for r in (1, 2, 3, 4)]
    cost = rows_cost_model(samples, points, slo_p99_ms=500.0)
    assert sorted(cost.levels) == [1, 2, 4]
    assert cost.target_concurrency == 2  # c = 4 reaches 800 ms
    assert cost.levels[4].latency_ms(3, 0) == pytest.approx(600.0)


def test_weighted_percentile_is_nearest_rank_with_unit_weights_and_counts_weights():
    values = [40.0, 10.0, 30.0, 20.0, 50.0]
    for q in (0.01, 0.5, 0.9, 0.99, 1.0):
        assert weighted_percentile(np.array(values), np.ones(5), q) == nearest_rank_percentile(values, q)
    assert weighted_percentile(np.array([10.0, 1000.0]), np.array([98.0, 2.0]), 0.99) == 1000.0
    assert weighted_percentile(np.array([10.0, 1000.0]), np.array([99.0, 1.0]), 0.99) == 10.0
    assert math.isnan(weighted_percentile(np.array([]), np.array([]), 0.5))


def test_percentiles_of_nothing_are_none():
    assert percentiles([]) == {"requests": 0, "p50_ms": None, "p99_ms": None}
    assert percentiles([100.0, 200.0]) == {"requests": 2.0, "p50_ms": 100.0, "p99_ms": 200.0}


def test_simulated_latency_is_the_whole_tick_wait_plus_each_size_at_the_ticks_concurrency():
    cost = cost_model({1: (50.0, 0.0), 3: (50.0, 200.0)})
    chunks = np.array([[0, 0, 3], [0, 1, 1]])  # 3 served at once, 1 after waiting a tick
    concurrency = np.array([1.0, 2.0])  # γ at 2 interpolates to 100 ms
    latency, weight, arrived = sim_latencies(chunks, concurrency, cost, rows=np.array([1, 1, 1, 3]))
    order = np.argsort(latency)
    assert latency[order].tolist() == pytest.approx([50.0, 150.0, 1150.0, 1250.0])
    assert weight[order].tolist() == pytest.approx([2.25, 0.75, 0.75, 0.25])
    assert weight.sum() == pytest.approx(4.0) and arrived.tolist() == [0, 0, 0, 0]


def test_a_polled_count_reads_the_last_value_at_each_tick():
    assert step_series([], 3, initial=1).tolist() == [1, 1, 1]
    assert step_series([(0.0, 1), (5.2, 2), (7.0, 1)], 9).tolist() == [1, 1, 1, 1, 1, 1, 2, 1, 1]


def test_replica_counts_differ_by_their_mean_absolute_and_max_gap():
    got = count_difference(np.array([1, 1, 2, 2]), np.array([1, 2, 2, 3]))
    assert got == {"mean_abs": 0.5, "max_abs": 1, "ticks_equal_share": 0.5, "replica_s_measured": 6.0,
                   "replica_s_predicted": 8.0}
    with pytest.raises(ValueError):
        count_difference(np.array([1, 2]), np.array([1]))


def side(p50, p99, ready):
    figures = {"requests": 10, "p50_ms": p50, "p99_ms": p99}
    return {"latency": {"all": figures, "step": figures}, "ready": np.array(ready), "total": np.array(ready)}


def test_the_comparison_is_predicted_over_measured_and_the_goal_a_band_around_one():
    comparison = compare(side(100.0, 400.0, [1, 2, 2]), side(80.0, 500.0, [1, 1, 2]))
    ratios = comparison["latency_ratio_predicted_over_measured"]
    assert ratios["all"] == {"p50": 0.8, "p99": 1.25}
    assert comparison["ready_replicas"]["max_abs"] == 1
    assert verdict(comparison) == (1.25, True, None)
    ratio, meets, why = verdict(compare(side(100.0, 400.0, [1]), side(100.0, 700.0, [1])))
    assert (ratio, meets) == (1.75, False) and "outside" in why
    ratio, meets, why = verdict(compare(side(None, None, [1]), side(100.0, 700.0, [1])))
    assert math.isnan(ratio) and not meets


def test_the_quick_run_steps_up_inside_its_two_minutes():
    assert 0 < QUICK.step_at_s < QUICK.step_end_s < QUICK.duration_s <= 150


def test_every_phase_and_the_replica_count_must_hold_not_only_the_whole_run():
    measured, predicted = side(100.0, 400.0, [1, 2, 2]), side(100.0, 400.0, [1, 2, 2])
    predicted["latency"]["step"] = {"requests": 10, "p50_ms": 100.0, "p99_ms": 1600.0}  # 4× in one phase
    ratio, meets, why = verdict(compare(measured, predicted))
    assert (ratio, meets) == (1.0, False) and "step p99 ratio 4.0" in why
    ratio, meets, why = verdict(compare(side(100.0, 400.0, [1, 1, 1, 1]), side(100.0, 400.0, [2, 2, 1, 1])))
    assert meets and why is None  # 0.5 replicas apart on average is within the goal
    ratio, meets, why = verdict(compare(side(100.0, 400.0, [1, 1, 1, 1]), side(100.0, 400.0, [2, 2, 2, 1])))
    assert not meets and "ready replicas differ by 0.75 on average" in why
