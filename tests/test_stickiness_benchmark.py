"""benchmarks/stickiness.py on a tiny setting: it runs, writes the common JSON shape, and its figures hang together."""

import json

import pytest

from benchmarks import stickiness


def test_quick_run_writes_the_common_shape(tmp_path):
    out = tmp_path / "stickiness.json"
    stickiness.main(["--quick", "--requests", "2000", "--repeats", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert {"benchmark", "ours", "anchor", "ratio", "goal", "meets_goal", "machine"} <= set(result)
    assert result["benchmark"] == "stickiness"
    ours, anchor = result["ours"], result["anchor"]
    for side in (ours, anchor):
        assert len(side["repeats"]) == 2
        for name in stickiness.FIGURES:
            assert set(side[name]) == {"min", "median", "max", "n"}
    assert anchor["home_share"]["min"] == 1.0          # consistent hashing always goes home
    assert ours["placements_over_bound"]["max"] == 0.0  # bounded load never places over its bound
    assert anchor["placements_over_bound"]["max"] > 0.0
    assert 0.0 < ours["home_share"]["median"] < 1.0
    assert result["ratio"] == pytest.approx(ours["peak_ratio_anchor_over_ours"]["median"], abs=1e-3)
    assert result["ratio"] > 1.0
    assert result["meets_goal"] == all(check["ok"] for check in ours["checks"].values())
    assert set(ours["load_factor_sweep"]) == {"1", "1.1", "1.25", "1.5", "2"}


def test_the_same_seed_gives_the_same_workload_and_another_seed_another():
    assert stickiness.workload(500, seed=3) == stickiness.workload(500, seed=3)
    assert stickiness.workload(500, seed=3) != stickiness.workload(500, seed=4)


@pytest.mark.parametrize("ours, failing", [
    ([{"home_share": 0.85, "placements_over_bound": 0.0}, {"home_share": 0.81, "placements_over_bound": 0.0}], set()),
    ([{"home_share": 0.85, "placements_over_bound": 0.0}, {"home_share": 0.79, "placements_over_bound": 0.0}],
     {"home_share_kept"}),  # one repeat below 0.8 is enough to miss the goal
    ([{"home_share": 0.9, "placements_over_bound": 0.001}, {"home_share": 0.9, "placements_over_bound": 0.0}],
     {"bound_held"}),
])
def test_the_goal_needs_the_home_share_and_the_bound_in_every_repeat(ours, failing):
    anchor = [{"home_share": 1.0, "placements_over_bound": 0.4}] * 2
    checks = stickiness.judge(ours, anchor)
    assert {name for name, check in checks.items() if not check["ok"]} == failing
