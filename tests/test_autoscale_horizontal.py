"""The horizontal policy: ceil(in flight / target), fast up, slow down, to zero and back."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoscale.clock import FakeClock
from autoscale.horizontal import (HorizontalConfig, HorizontalSignals, HorizontalState, Sample, decide,
                                  initial_state)

CONFIG = HorizontalConfig(min_replicas=1, max_replicas=20, target=4)
TO_ZERO = replace(CONFIG, min_replicas=0)


def flat(start_s: int, end_s: int, in_flight: float) -> tuple[Sample, ...]:
    """One sample a second over [start_s, end_s]."""
    return tuple(Sample(float(t), in_flight) for t in range(start_s, end_s + 1))


def signals(samples, ready, starting=0, waiting=0) -> HorizontalSignals:
    return HorizontalSignals(tuple(samples), ready_replicas=ready, starting_replicas=starting,
                             waiting_requests=waiting)


def state(desired, history_since_s=0.0, last_check_s=None, last_traffic_s=None) -> HorizontalState:
    return HorizontalState(desired, history_since_s, last_check_s, last_traffic_s)


CASES = {
    # name: (config, signals, state, now_s, expected replicas, expected rule)
    "a ramp scales up at the first check, growth capped at 2 × capacity or +4":
        (CONFIG, signals(flat(0, 97, 8) + flat(98, 100, 37), ready=2), state(2, last_check_s=95), 100, 6, "scale-up"),
    "a ramp waits for the scale-up interval (3 s since the last check)":
        (CONFIG, signals(flat(0, 97, 8) + flat(98, 100, 37), ready=2), state(2, last_check_s=97), 100, 2, "hold"),
    "scale-up uses the peak of the last 20 s, not the last sample":
        (CONFIG, signals(flat(0, 85, 4) + flat(86, 90, 37) + flat(91, 100, 4), ready=10), state(10, last_check_s=95),
         100, 10, "hold"),
    "growth per cycle is at most 2 × capacity (6 → 12, not 50)":
        (replace(CONFIG, max_replicas=100), signals(flat(90, 100, 200), ready=6),
         state(6, last_check_s=90), 100, 12, "scale-up"),
    "growth per cycle is at least +4 (1 → 5)":
        (replace(CONFIG, max_replicas=100), signals(flat(90, 100, 200), ready=1), state(1, last_check_s=90), 100, 5,
         "scale-up"),
    "starting replicas count as capacity: no re-order while the last order loads":
        (CONFIG, signals(flat(90, 100, 37), ready=2, starting=8), state(10, last_check_s=90), 100, 10, "hold"),
    "with replicas starting, only the shortfall beyond them is ordered":
        (CONFIG, signals(flat(90, 100, 48), ready=2, starting=8), state(10, last_check_s=90), 100, 12, "scale-up"),
    "an order below the replicas loading rises to cover them, and adds none (a restart's stale order)":
        (CONFIG, signals(flat(90, 100, 37), ready=2, starting=8), state(2, last_check_s=90), 100, 10, "scale-up"),
    "a rise within the replicas still ready (a scale-down draining) keeps them rather than start new ones":
        (CONFIG, signals(flat(90, 100, 32), ready=10), state(6, last_check_s=90), 100, 8, "scale-up"),
    "scale-down holds while the 300 s lookback still holds the peak":
        (CONFIG, signals(flat(0, 100, 40) + flat(101, 399, 4), ready=10), state(10, last_check_s=395), 399, 10,
         "hold"),
    "scale-down once the peak leaves the 300 s lookback":
        (CONFIG, signals(flat(0, 100, 40) + flat(101, 400, 4), ready=10), state(10, last_check_s=395), 400, 1,
         "scale-down"),
    "scale-down to what the lookback's peak needs, not below":
        (CONFIG, signals(flat(0, 100, 40) + flat(101, 400, 13), ready=10), state(10, last_check_s=395), 400, 4,
         "scale-down"),
    "a restarted controller with 60 s of history never scales down":
        (CONFIG, signals(flat(340, 400, 4), ready=10), state(10, history_since_s=340, last_check_s=395), 400, 10,
         "no-history"),
    "while a replica loads, a reduction cancels the order the lookback no longer justifies, not a ready replica":
        (CONFIG, signals(flat(0, 400, 4), ready=9, starting=1), state(10, last_check_s=395), 400, 9, "loading"),
    "while replicas load, every order beyond the ready replicas is cancelled and the ready ones kept":
        (CONFIG, signals(flat(0, 400, 4), ready=3, starting=7), state(10, last_check_s=395), 400, 3, "loading"),
    "while a replica loads, the ready ones are held even where the lookback wants fewer":
        (CONFIG, signals(flat(0, 400, 4), ready=10, starting=1), state(10, last_check_s=395), 400, 10, "loading"),
    "while replicas load, a reduction that keeps every ready replica goes through":
        (CONFIG, signals(flat(0, 400, 24), ready=2, starting=8), state(10, last_check_s=395), 400, 6, "scale-down"),
    "scale to zero after the grace (300 s without traffic)":
        (TO_ZERO, signals(flat(0, 100, 4) + flat(101, 400, 0), ready=1), state(1, last_check_s=395), 400, 0,
         "scale-to-zero"),
    "no scale to zero before the grace (299 s without traffic)":
        (TO_ZERO, signals(flat(0, 100, 4) + flat(101, 399, 0), ready=1), state(1, last_check_s=395), 399, 1, "hold"),
    "no scale to zero with min_replicas 1, however long the silence":
        (CONFIG, signals(flat(0, 4000, 0), ready=1), state(1, last_check_s=3995), 4000, 1, "hold"),
    "a restarted controller does not scale to zero on 60 s of silence":
        (replace(TO_ZERO, scale_to_zero_grace_s=30), signals(flat(340, 400, 0), ready=1),
         state(1, history_since_s=340, last_check_s=395), 400, 1, "no-history"),
    "a request waiting at zero orders a replica at once, between scale-up checks":
        (TO_ZERO, signals(flat(0, 1000, 0), ready=0, waiting=1), state(0, last_check_s=999), 1000, 1, "from-zero"),
    "from zero, a burst orders ceil(waiting / target), capped at the growth limit of 4":
        (TO_ZERO, signals(flat(0, 1000, 0), ready=0, waiting=30), state(0, last_check_s=999), 1000, 4, "from-zero"),
    "a request waiting while the first replica loads orders no second one":
        (TO_ZERO, signals(flat(0, 1000, 0), ready=0, starting=1, waiting=3), state(1, last_check_s=990), 1000, 1,
         "hold"),
    "min_replicas holds when the last order was below it":
        (replace(CONFIG, min_replicas=2), signals(flat(0, 400, 0), ready=0), state(0, last_check_s=395), 400, 2, "min"),
    "max_replicas caps a scale-up":
        (replace(CONFIG, max_replicas=8), signals(flat(90, 100, 37), ready=6), state(6, last_check_s=90), 100, 8,
         "max"),
    "no samples in the lookback: hold what was ordered":
        (CONFIG, signals((), ready=3), state(3, last_check_s=90), 100, 3, "no-samples"),
}


@pytest.mark.parametrize("config, observed, before, now_s, replicas, rule", CASES.values(), ids=CASES.keys())
def test_decision_table(config, observed, before, now_s, replicas, rule):
    decision, after = decide(observed, config, before, float(now_s))
    assert (decision.replicas, decision.rule) == (replicas, rule), decision.reason
    assert after.desired == decision.replicas


def test_the_reason_carries_the_numbers():
    decision, _ = decide(signals(flat(90, 100, 37), ready=8), replace(CONFIG, max_replicas=8),
                         state(8, last_check_s=90), 100.0)
    assert decision.reason == "in flight 37.0 over the last 20 s / target 4 = 10 replicas, capped at max_replicas 8"
    assert decision.inputs["in_flight_peak_up"] == 37.0 and decision.inputs["want_up"] == 10


def test_a_scale_up_within_capacity_says_it_adds_no_replica():
    decision, _ = decide(signals(flat(90, 100, 32), ready=10), CONFIG, state(6, last_check_s=90), 100.0)
    assert decision.reason == ("in flight 32.0 over the last 20 s / target 4 = 8 replicas, already ready or "
                               "starting: no new replica")


def test_scale_up_checks_are_spaced_by_the_interval_in_seconds_not_calls():
    decision, after = decide(signals(flat(0, 100, 4), ready=1), CONFIG, state(1, last_check_s=95), 100.0)
    assert after.last_scale_up_check_s == 100.0
    _, later = decide(signals(flat(0, 103, 4), ready=1), CONFIG, after, 103.0)
    assert later.last_scale_up_check_s == 100.0


def test_last_traffic_is_remembered_across_calls():
    _, after = decide(signals(flat(0, 100, 4) + flat(101, 110, 0), ready=1), TO_ZERO, state(1), 110.0)
    assert after.last_traffic_s == 100.0
    _, later = decide(signals(flat(200, 210, 0), ready=1), TO_ZERO, after, 210.0)  # samples no longer show it
    assert later.last_traffic_s == 100.0


def test_a_ramp_is_answered_within_one_scale_up_interval():
    """Drive the policy each second with a fake clock; demand jumps at t = 100 s."""
    clock, held, ready = FakeClock(), [], 2
    current = initial_state(2, clock.now_s())
    ordered_at_s = None
    while clock.now_s() < 130 and ordered_at_s is None:
        held.append(Sample(clock.now_s(), 37.0 if clock.now_s() >= 100 else 6.0))
        decision, current = decide(signals(held[-300:], ready=ready), CONFIG, current, clock.now_s())
        if decision.rule == "scale-up":
            ordered_at_s = clock.now_s()
        clock.advance(1.0)
    assert ordered_at_s is not None and 100 <= ordered_at_s <= 100 + CONFIG.scale_up_interval_s


def test_config_rejects_inconsistent_bounds():
    with pytest.raises(ValueError, match="min_replicas"):
        HorizontalConfig(min_replicas=5, max_replicas=3, target=4)
    with pytest.raises(ValueError, match="target"):
        HorizontalConfig(min_replicas=0, max_replicas=3, target=0)


# Properties: any signals, any state the policy could have left.

configs = st.builds(lambda lo, extra, target: HorizontalConfig(lo, max(lo, 1) + extra, target),
                    st.integers(0, 5), st.integers(0, 30), st.floats(0.5, 16))


@st.composite
def situations(draw):
    config = draw(configs)
    now_s = draw(st.floats(0, 2000))
    history_since_s = draw(st.floats(0, now_s))
    times = draw(st.lists(st.floats(max(history_since_s, now_s - 300), now_s), max_size=30))
    samples = tuple(Sample(t, draw(st.floats(0, 500))) for t in sorted(times))
    observed = signals(samples, ready=draw(st.integers(0, 40)), starting=draw(st.integers(0, 10)),
                       waiting=draw(st.integers(0, 50)))
    before = state(draw(st.integers(config.min_replicas, config.max_replicas)), history_since_s,
                   draw(st.none() | st.floats(0, now_s)), draw(st.none() | st.floats(0, now_s)))
    return config, observed, before, now_s


@settings(max_examples=400, deadline=None)
@given(situations())
def test_the_result_stays_within_min_and_max(situation):
    config, observed, before, now_s = situation
    decision, _ = decide(observed, config, before, now_s)
    assert config.min_replicas <= decision.replicas <= config.max_replicas
    assert decision.replicas > 0 or config.min_replicas == 0


@settings(max_examples=400, deadline=None)
@given(situations())
def test_no_ready_replica_is_stopped_while_replicas_are_starting(situation):
    config, observed, before, now_s = situation
    observed = replace(observed, starting_replicas=max(observed.starting_replicas, 1))
    decision, _ = decide(observed, config, before, now_s)
    assert decision.replicas >= min(before.desired, max(observed.ready_replicas, config.min_replicas))


@settings(max_examples=400, deadline=None)
@given(situations())
def test_no_reduction_without_a_full_lookback_of_history(situation):
    config, observed, before, now_s = situation
    before = replace(before, history_since_s=max(before.history_since_s, now_s - config.scale_down_window_s + 1))
    decision, _ = decide(observed, config, before, now_s)
    assert decision.replicas >= before.desired
