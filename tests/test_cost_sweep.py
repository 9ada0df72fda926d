"""What a cost sweep runs and how one point's requests are summed up."""

import json
import math

import pytest

from costmodel.sweep import RequestSample, SweepGrid, SweepPoint, nearest_rank_percentile


def sample(latency_ms: float, *, ok: bool = True, ttft_ms: float | None = None, input_tokens: int = 64,
           output_tokens: int = 16, concurrency: int = 4) -> RequestSample:
    return RequestSample(input_tokens, output_tokens, concurrency, latency_ms, ttft_ms, ok)


# ---- grids ------------------------------------------------------------------------------------

def test_quick_grid_is_two_by_two_shapes_at_two_levels():
    grid = SweepGrid.quick()
    assert list(grid.points()) == [(16, 4, 1), (16, 16, 1), (64, 4, 1), (64, 16, 1),
                                   (16, 4, 4), (16, 16, 4), (64, 4, 4), (64, 16, 4)]
    assert grid.n_points == 8
    assert [grid.requests_for(c) for c in grid.concurrency] == [8, 8]


def test_default_grid_has_24_points_lowest_concurrency_first():
    grid = SweepGrid.default()
    points = list(grid.points())
    assert len(points) == grid.n_points == 24
    assert [c for _, _, c in points] == sorted(c for _, _, c in points)
    assert {(i, o) for i, o, _ in points} == {(i, o) for i in (32, 128, 384) for o in (16, 48)}


@pytest.mark.parametrize(("concurrency", "requests"), [(1, 8), (4, 8), (8, 16), (16, 32)])
def test_requests_per_point_cover_two_rounds_of_workers(concurrency, requests):
    assert SweepGrid.default().requests_for(concurrency) == requests


@pytest.mark.parametrize(("seconds_per_request", "expected_s"), [(1.0, 84.0), (2.0, 132.0)])
def test_estimated_duration_counts_waves_of_closed_loop_workers(seconds_per_request, expected_s):
    # 1 s: concurrency 1 sends 8 waves of 1 s at 6 points (48 s), the other 18 points 2 waves (36 s).
    assert SweepGrid.default().estimated_duration_s(seconds_per_request) == pytest.approx(expected_s)


@pytest.mark.parametrize("seconds_per_request", [0.25, 0.5, 1.0, 2.0, 3.0])
def test_default_sweep_fits_in_four_minutes_for_plausible_request_times(seconds_per_request):
    assert SweepGrid.default().estimated_duration_s(seconds_per_request) < 240


def test_time_budget_caps_a_slow_point():
    # 9 s budget, 4 s requests: waves start at 0, 4 and 8 s, so 3 of the 8 waves at concurrency 1.
    grid = SweepGrid((32,), (16,), (1,), requests_per_point=8, max_point_s=9.0)
    assert grid.estimated_duration_s(4.0) == pytest.approx(12.0)


def test_classic_grid_sweeps_concurrency_only():
    grid = SweepGrid.classic()
    assert list(grid.points()) == [(0, 0, 1), (0, 0, 4), (0, 0, 16), (0, 0, 32)]
    assert grid.requests_for(32) == 64
    assert [c for _, _, c in SweepGrid.classic(concurrency=(2, 8)).points()] == [2, 8]


@pytest.mark.parametrize("fields", [
    {"input_tokens": ()}, {"concurrency": (0, 4)}, {"output_tokens": (4, 4)}, {"requests_per_point": 0},
    {"max_point_s": 0.0}, {"input_tokens": (-1,)},
])
def test_grid_refuses_a_sweep_that_cannot_run(fields):
    arguments = {"input_tokens": (16,), "output_tokens": (4,), "concurrency": (1,), "requests_per_point": 8,
                 "max_point_s": 5.0} | fields
    with pytest.raises(ValueError):
        SweepGrid(**arguments)


# ---- percentiles and aggregation ---------------------------------------------------------------

@pytest.mark.parametrize(("values", "q", "expected"), [
    ([float(v) for v in range(1, 201)], 0.99, 198.0),
    ([float(v) for v in range(1, 201)], 0.5, 100.0),
    ([float(v) for v in range(1, 101)], 0.99, 99.0),
    ([5.0, 1.0, 3.0, 2.0, 4.0], 0.5, 3.0),
    ([float(v) for v in range(1, 9)], 0.99, 8.0),
    ([7.0], 0.99, 7.0),
])
def test_nearest_rank_percentile_is_a_measured_value(values, q, expected):
    assert nearest_rank_percentile(values, q) == expected


def test_percentile_of_nothing_is_nan():
    assert math.isnan(nearest_rank_percentile([], 0.99))


def test_aggregate_sums_up_successes_and_counts_failures():
    samples = [sample(300.0, ttft_ms=30.0), sample(100.0, ttft_ms=10.0), sample(200.0, ttft_ms=20.0),
               sample(5000.0, ok=False)]
    point = SweepPoint.aggregate(samples, wall_s=2.0)
    assert (point.input_tokens, point.output_tokens, point.concurrency) == (64, 16, 4)
    assert (point.n_ok, point.n_failed) == (3, 1)
    assert point.mean_latency_ms == pytest.approx(200.0)  # the failure's 5 s is not a latency
    assert (point.p50_latency_ms, point.p99_latency_ms, point.p99_ttft_ms) == (200.0, 300.0, 30.0)
    assert point.throughput_rps == pytest.approx(1.5)
    assert point.output_tokens_per_s == pytest.approx(3 * 16 / 2.0)


def test_aggregate_of_unstreamed_requests_has_no_ttft():
    assert SweepPoint.aggregate([sample(100.0), sample(120.0)], wall_s=1.0).p99_ttft_ms is None


def test_aggregate_of_failures_only_has_no_latency():
    point = SweepPoint.aggregate([sample(1.0, ok=False)] * 3, wall_s=1.0)
    assert (point.n_ok, point.n_failed, point.throughput_rps) == (0, 3, 0.0)
    assert math.isnan(point.p99_latency_ms) and math.isnan(point.mean_latency_ms)


def test_aggregate_takes_the_nominal_shape_when_token_counts_vary():
    samples = [sample(100.0, input_tokens=130), sample(110.0, input_tokens=131)]
    with pytest.raises(ValueError, match="nominal"):
        SweepPoint.aggregate(samples, wall_s=1.0)
    point = SweepPoint.aggregate(samples, wall_s=1.0, input_tokens=128, output_tokens=16)
    assert point.shape == (128, 16)


@pytest.mark.parametrize(("samples", "wall_s"), [
    ([], 1.0), ([sample(100.0)], 0.0), ([sample(100.0, concurrency=1), sample(100.0, concurrency=4)], 1.0),
])
def test_aggregate_refuses_what_is_not_one_point(samples, wall_s):
    with pytest.raises(ValueError):
        SweepPoint.aggregate(samples, wall_s=wall_s)


# ---- JSON --------------------------------------------------------------------------------------

@pytest.mark.parametrize("original", [sample(123.5, ttft_ms=12.0), sample(math.nan, ok=False)])
def test_request_sample_survives_strict_json(original):
    text = json.dumps(original.to_json(), allow_nan=False)
    restored = RequestSample.from_json(json.loads(text))
    assert restored.to_json() == original.to_json()
    if math.isfinite(original.latency_ms):
        assert restored == original


@pytest.mark.parametrize("samples", [
    [sample(100.0, ttft_ms=9.0), sample(140.0, ttft_ms=11.0)],
    [sample(1.0, ok=False)],
])
def test_sweep_point_survives_strict_json(samples):
    original = SweepPoint.aggregate(samples, wall_s=1.5)
    restored = SweepPoint.from_json(json.loads(json.dumps(original.to_json(), allow_nan=False)))
    assert restored.to_json() == original.to_json()
    if original.n_ok:
        assert restored == original
