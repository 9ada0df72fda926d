"""The cost-model benchmark's pure helpers: trace scaling, errors, the replay level."""

import pytest

from benchmarks.cost_model import (TRACE_CSV, TraceScaling, abs_pct_errors, error_summary, read_trace,
                                   replay_concurrency, sample_trace)


def test_scaling_maps_the_medians_to_128_by_32_and_clamps():
    scaling = TraceScaling.from_medians(1020, 129)
    assert scaling.shape(1020, 129) == (128, 32)
    assert scaling.shape(1, 1) == (8, 4)
    assert scaling.shape(100_000, 10_000) == (512, 64)


def test_errors_are_percent_of_measured_and_skip_zero():
    assert abs_pct_errors([100.0, 0.0, 50.0], [90.0, 5.0, 100.0]) == [10.0, 100.0]
    summary = error_summary([float(n) for n in range(1, 11)])
    assert summary == {"n": 10, "median_abs_pct_error": 5.5, "p90_abs_pct_error": 9.0}
    assert error_summary([])["median_abs_pct_error"] is None


@pytest.mark.parametrize(("target", "swept", "level"), [(1, (1, 4, 8, 16), 8), (1, (1, 8), 8), (4, (1, 4, 8), 4),
                                                         (16, (1, 4, 8, 16), 16), (1, (1,), 1)])
def test_replay_level_is_the_target_unless_that_is_one(target, swept, level):
    assert replay_concurrency(target, swept)[0] == level


@pytest.mark.skipif(not TRACE_CSV.is_file(), reason="the Azure trace is not on this machine")
def test_trace_sample_is_seeded_and_within_the_clamps():
    rows = read_trace()
    first, scaling = sample_trace(rows, 24, seed=0)
    assert sample_trace(rows, 24, seed=0)[0] == first
    assert (scaling.median_context_tokens, scaling.median_generated_tokens) == (1020, 129)
    assert all(8 <= i <= 512 and 4 <= o <= 64 for i, o in first)
