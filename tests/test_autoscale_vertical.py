"""The vertical policy: retune the per-replica target from latency, queue and utilization, in bounded steps."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoscale.vertical import (TargetDecision, VerticalConfig, VerticalSignals, VerticalState, initial_vertical_state,
                                target_bounds, tune)

CONFIG = VerticalConfig(initial_target=8, min_target=1, max_target=16, slo_p99_ms=500)


def seen(p99_ms, queue=0.0, cpu=0.5, gpu=None, kv=None, in_flight=None) -> VerticalSignals:
    return VerticalSignals(p99_ms, queue, cpu, gpu, kv, requests=100, in_flight_per_replica=in_flight)


CASES = {
    # name: (config, signals, state, now_s, expected target, expected rule)
    "p99 at 1.4 × the SLO cuts in proportion: 8 × 500 / 700":
        (CONFIG, seen(700), VerticalState(8), 100, 8 * 500 / 700, "cut"),
    "p99 at 3 × the SLO cuts at most by half in one cycle":
        (CONFIG, seen(1500), VerticalState(8), 100, 4, "cut"),
    "a cut stops at min_target":
        (replace(CONFIG, min_target=1.5), seen(1500), VerticalState(2), 100, 1.5, "cut"),
    "at min_target an overloaded endpoint stays there":
        (CONFIG, seen(1500), VerticalState(1), 100, 1, "bound"),
    "GPU above 90 % cuts even with p99 within the SLO: 8 × 0.9 / 0.99":
        (CONFIG, seen(400, gpu=0.99), VerticalState(8), 100, 8 * 0.9 / 0.99, "cut"),
    "a full KV cache cuts":
        (CONFIG, seen(300, kv=0.96), VerticalState(8), 100, 8 * 0.9 / 0.96, "cut"),
    "CPU above 90 % cuts":
        (CONFIG, seen(300, cpu=0.95), VerticalState(8), 100, 8 * 0.9 / 0.95, "cut"),
    "4 queued per replica in the engine cuts: 8 × 8 / (8 + 4)":
        (CONFIG, seen(400, queue=4.0), VerticalState(8), 100, 8 * 8 / 12, "cut"),
    "the strongest sign of stress sets the cut":
        (CONFIG, seen(600, gpu=0.99, queue=8.0), VerticalState(8), 100, 8 * 8 / 16, "cut"),
    "p99 at half the SLO, nothing stressed, raises by 10 %":
        (CONFIG, seen(250), VerticalState(8), 100, 8.8, "raise"),
    "a raise stops at max_target":
        (CONFIG, seen(250), VerticalState(15.5), 100, 16, "raise"),
    "at max_target a fast endpoint stays there":
        (CONFIG, seen(250), VerticalState(16), 100, 16, "bound"),
    "low p99 at low load is no evidence for a higher target":
        (CONFIG, seen(250, in_flight=2.0), VerticalState(8), 100, 8, "hold"),
    "low p99 at full load raises":
        (CONFIG, seen(250, in_flight=7.0), VerticalState(8), 100, 8.8, "raise"),
    "low p99 with 0.8 queued per replica (under the stress line of 1) does not raise: no oscillation":
        (CONFIG, seen(250, queue=0.8), VerticalState(8), 100, 8, "hold"),
    "low p99 with 0.5 queued per replica raises":
        (CONFIG, seen(250, queue=0.5), VerticalState(8), 100, 8.8, "raise"),
    "low p99 with a hot GPU does not raise (it cuts)":
        (CONFIG, seen(250, gpu=0.95), VerticalState(8), 100, 8 * 0.9 / 0.95, "cut"),
    "p99 at 0.9 × the SLO is in the dead band":
        (CONFIG, seen(450), VerticalState(8), 100, 8, "dead-band"),
    "p99 at 1.05 × the SLO is in the dead band":
        (CONFIG, seen(525), VerticalState(8), 100, 8, "dead-band"),
    "p99 at exactly 0.7 × the SLO is in the dead band":
        (CONFIG, seen(350), VerticalState(8), 100, 8, "dead-band"),
    "p99 at 3 × the SLO with replicas at 12 in flight, over target 8 × 1.1: too few replicas, not a high target":
        (CONFIG, seen(1500, in_flight=12.0), VerticalState(8), 100, 8, "over-target"),
    "a hot GPU with replicas over their target holds the target too":
        (CONFIG, seen(400, gpu=0.99, in_flight=9.0), VerticalState(8), 100, 8, "over-target"),
    "p99 at 3 × the SLO with replicas at 8.8 in flight (exactly target × 1.1) still cuts":
        (CONFIG, seen(1500, in_flight=8.8), VerticalState(8), 100, 4, "cut"),
    "no request completed: hold":
        (CONFIG, seen(None), VerticalState(8), 100, 8, "hold"),
    "29 s after a change: hold, however slow":
        (CONFIG, seen(1500), VerticalState(8, last_change_s=71), 100, 8, "hold"),
    "30 s after a change: act":
        (CONFIG, seen(1500), VerticalState(8, last_change_s=70), 100, 4, "cut"),
    "a target outside the bounds (config changed) is brought inside at once":
        (CONFIG, seen(450), VerticalState(20, last_change_s=99), 100, 16, "bound"),
}


@pytest.mark.parametrize("config, observed, before, now_s, target, rule", CASES.values(), ids=CASES.keys())
def test_tune_table(config, observed, before, now_s, target, rule):
    decision, after = tune(observed, config, before, float(now_s))
    assert (decision.target, decision.rule) == (pytest.approx(target), rule), decision.reason
    assert after.target == decision.target
    changed = decision.target != before.target
    assert after.last_change_s == (float(now_s) if changed else before.last_change_s)


def test_the_worked_example_reason():
    decision, _ = tune(seen(700), CONFIG, initial_vertical_state(CONFIG), 0.0)
    assert decision == TargetDecision(pytest.approx(5.714, abs=1e-3), "cut",
                                      "p99 700 ms > 550 ms (1.1 × SLO 500 ms): target 8.00 × 0.71 → 5.71",
                                      decision.inputs)
    assert decision.inputs["p99_latency_ms"] == 700 and decision.inputs["target_before"] == 8


def test_it_starts_from_the_benchmarked_target_free_to_act():
    assert initial_vertical_state(CONFIG) == VerticalState(8, None)


BOUNDS = {
    "the smallest to the largest swept level": ([1, 2, 4, 8, 16], 8, (1, 16)),
    "a target below the sweep widens the lower bound": ([4, 8], 2, (2, 8)),
    "a target above the sweep widens the upper bound": ([1, 2, 4], 6, (1, 6)),
    "no level below 1": ([0, 2, 4], 2, (1, 4)),
    "an empty sweep allows cuts down to 1 only": ([], 6, (1, 6)),
}


@pytest.mark.parametrize("levels, target, bounds", BOUNDS.values(), ids=BOUNDS.keys())
def test_target_bounds(levels, target, bounds):
    assert target_bounds(levels, target) == bounds


def test_config_rejects_an_initial_target_outside_its_bounds():
    with pytest.raises(ValueError, match="min_target"):
        VerticalConfig(initial_target=20, min_target=1, max_target=16, slo_p99_ms=500)


@st.composite
def situations(draw):
    low = draw(st.floats(0.5, 10))
    high = low + draw(st.floats(0, 50))
    target = draw(st.floats(low, high))
    config = VerticalConfig(target, low, high, slo_p99_ms=draw(st.floats(10, 5000)))
    utilization = st.none() | st.floats(0, 1)
    observed = VerticalSignals(draw(st.none() | st.floats(0, 1e5)), draw(st.floats(0, 100)), draw(utilization),
                               draw(utilization), draw(utilization), requests=draw(st.integers(0, 1000)),
                               in_flight_per_replica=draw(st.none() | st.floats(0, 100)))
    before = VerticalState(target, draw(st.none() | st.floats(0, 1000)))
    return config, observed, before, draw(st.floats(1000, 2000))


@settings(max_examples=500, deadline=None)
@given(situations())
def test_one_step_never_exceeds_its_bound_and_stays_within_min_and_max(situation):
    config, observed, before, now_s = situation
    decision, after = tune(observed, config, before, now_s)
    assert config.min_target <= decision.target <= config.max_target
    assert before.target * (1 - config.max_step_down) - 1e-9 <= decision.target
    assert decision.target <= before.target * (1 + config.max_step_up) + 1e-9
    assert after.target == decision.target
