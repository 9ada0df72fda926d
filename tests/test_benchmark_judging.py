"""How the benchmarks judge what they measured: every level counts, a failing anchor is no
baseline, and no ratio is ever infinite."""

import json

import pytest

from benchmarks.machine import write_result
from benchmarks.pyfunc_vs_mlflow import compare
from benchmarks.runtime_vs_vllm import judge


def level(tokens_per_s: float, p99_ms: float, errors: int = 0) -> dict:
    return {"server_output_tokens_per_s": tokens_per_s, "p99_ms": p99_ms, "errors": errors}


def test_the_goal_holds_only_when_it_holds_at_every_level():
    ours = [[level(100, 50), level(200, 90)]] * 3
    good_anchor = [[level(100, 50), level(200, 90)]] * 3
    slow_low_level = [[level(100, 50), level(200, 90)], [level(100, 50), level(200, 90)], [level(100, 50), level(200, 90)]]
    assert judge(ours, good_anchor, [1, 16])[1]
    worse_at_one = [[level(80, 50), level(200, 90)]] * 3  # fine at the top, 20 % slower at concurrency 1
    by_level, meets, reason = judge(worse_at_one, slow_low_level, [1, 16])
    assert not meets and "concurrency 1: throughput ratio 0.8" in reason
    assert by_level["16"]["throughput_ratio"]["median"] == 1.0


def test_an_anchor_with_failed_requests_is_no_baseline():
    ours = [[level(100, 50)]] * 3
    anchor = [[level(50, 50, errors=3)]] * 3
    _, meets, reason = judge(ours, anchor, [4])
    assert not meets and "3 failed requests" not in reason and "9 on the anchor" in reason


def test_each_figure_is_given_as_min_median_max_of_the_repeats():
    ours = [[level(90, 50)], [level(100, 50)], [level(130, 50)]]
    anchor = [[level(100, 50)]] * 3
    by_level, _, _ = judge(ours, anchor, [4])
    assert by_level["4"]["throughput_ratio"] == {"min": 0.9, "median": 1.0, "max": 1.3, "n": 3}


def test_a_run_where_nothing_finished_counts_its_whole_window_as_its_p99():
    ours = [[level(100, 50)], [level(0, float("nan"))], [level(100, 50)]]
    anchor = [[level(100, 50)]] * 3
    by_level, _, _ = judge(ours, anchor, [4], duration_s=20.0)
    assert by_level["4"]["p99_ratio"] == {"min": 1.0, "median": 1.0, "max": 400.0, "n": 3}  # 20,000 ms / 50 ms
    assert by_level["4"]["throughput_ratio"]["min"] == 0.0


def test_an_anchor_that_measured_nothing_gives_a_zero_ratio_and_an_unmet_goal(tmp_path, capsys):
    path = tmp_path / "out.json"
    write_result(str(path), benchmark="b", ours={}, anchor={}, ratio=float("inf"), goal="g", meets_goal=True)
    result = json.loads(path.read_text())
    assert result["ratio"] == 0.0 and result["meets_goal"] is False and "measured nothing" in result["unmet_reason"]
    assert "Infinity" not in path.read_text()


@pytest.mark.parametrize("anchor_p99, expected", [(10.0, 2.0), (80.0, 0.0)])  # anchor within the SLO, or never
def test_pyfunc_comparison_gives_the_best_and_the_ratio_at_every_common_concurrency(anchor_p99, expected):
    ours = [{"concurrency": c, "throughput_rps": 100.0 * c, "p99_ms": 10.0, "errors": 0} for c in (1, 2, 4)]
    anchor = [{"concurrency": c, "throughput_rps": 100.0 * c / 2, "p99_ms": anchor_p99, "errors": 0} for c in (1, 2)]
    result = compare(ours, anchor, "throughput_rps")
    assert result["ratio_at_equal_concurrency"] == {"1": 2.0, "2": 2.0}
    assert result["ratio_best"] == (4.0 if expected else 0.0)


def test_pyfunc_goal_counts_every_repeat_load_and_level():
    from benchmarks.pyfunc_vs_mlflow import shortfalls, summarise

    ours = [{"concurrency": c, "throughput_rps": 400.0 * c, "p99_ms": 10.0, "errors": 0} for c in (1, 2)]
    anchor = [{"concurrency": c, "throughput_rps": 100.0 * c, "p99_ms": 10.0, "errors": 0} for c in (1, 2)]
    slow_at_one = [dict(ours[0], throughput_rps=250.0), ours[1]]
    good = {"uniform": compare(ours, anchor, "throughput_rps"), "mixed": compare(ours, anchor, "throughput_rps")}
    assert shortfalls([good] * 3) == []
    one_bad_repeat = [good, {**good, "mixed": compare(slow_at_one, anchor, "throughput_rps")}, good]
    assert shortfalls(one_bad_repeat) == ["repeat 2 mixed: 2.5x at concurrency 1"]
    spread_at_one = summarise(one_bad_repeat)["mixed"]["ratio_at_equal_concurrency"]["1"]
    assert (spread_at_one["min"], spread_at_one["median"], spread_at_one["max"]) == (2.5, 4.0, 4.0)
