"""Liveness by forward progress: verdicts for sequences of looks, time passed explicitly."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.runtime.base import Progress
from serving.runtime.liveness import LivenessConfig, LivenessState, Verdict, decide

A, P, H = Verdict.ALIVE, Verdict.PROBE, Verdict.HUNG
CONFIG = LivenessConfig(idle_probe_after_s=30, hang_after_s=60, probe_timeout_s=30)


def run(looks, config=CONFIG):
    """Feed (now_s, completed, in_flight, queued[, work]) looks through decide; return the verdicts."""
    state, verdicts = LivenessState(), []
    for now_s, completed, in_flight, queued, *work in looks:
        verdict, state = decide(Progress(completed, in_flight, queued, *work), state, now_s, config)
        verdicts.append(verdict)
    return verdicts


@pytest.mark.parametrize("looks, expected", [
    pytest.param([(0, 5, 0, 0), (29, 5, 0, 0)], [A, A], id="idle-under-probe-threshold"),
    pytest.param([(0, 5, 0, 0), (30, 5, 0, 0)], [A, P], id="idle-30s-probe"),
    pytest.param([(0, 5, 0, 0), (30, 5, 0, 0), (31, 5, 0, 0), (45, 5, 0, 0)], [A, P, A, A],
                 id="one-probe-at-a-time"),
    pytest.param([(0, 5, 0, 0), (30, 5, 0, 0), (31, 6, 0, 0), (60, 6, 0, 0), (61, 6, 0, 0)], [A, P, A, A, P],
                 id="answered-probe-resets-the-clock"),
    pytest.param([(0, 5, 0, 0), (30, 5, 0, 0), (59, 5, 0, 0), (60, 5, 0, 0)], [A, P, A, H],
                 id="unanswered-probe-hung-after-timeout"),
    pytest.param([(0, 5, 0, 0), (30, 5, 0, 0), (31, 5, 1, 0), (60, 5, 1, 0)], [A, P, A, H],
                 id="probe-in-flight-but-never-completes"),
    pytest.param([(0, 5, 3, 10), (59, 5, 3, 10), (60, 5, 3, 10)], [A, A, H], id="queued-no-progress-hung-at-60s"),
    pytest.param([(0, 5, 4, 200), (50, 6, 4, 200), (100, 7, 4, 200), (150, 8, 4, 200), (200, 9, 4, 200)],
                 [A, A, A, A, A], id="saturated-but-completing"),
    pytest.param([(0, 5, 0, 0), (25, 5, 0, 0), (26, 5, 2, 0), (70, 5, 2, 0), (86, 5, 2, 0)], [A, A, A, A, H],
                 id="hang-clock-starts-when-work-arrives"),
    pytest.param([(0, 900, 1, 0), (59, 0, 1, 0), (118, 0, 1, 0), (119, 0, 1, 0)], [A, A, A, H],
                 id="counter-reset-by-restart-counts-as-fresh-start"),
    # One long generation (2,000 tokens on a CPU replica): nothing completes for minutes, but
    # the engine's token counter moves, so it is alive; when the tokens stop, it is hung.
    pytest.param([(0, 5, 1, 0, 100), (59, 5, 1, 0, 900), (118, 5, 1, 0, 1700), (177, 5, 1, 0, 2100),
                  (236, 5, 1, 0, 2100), (237, 5, 1, 0, 2100)], [A, A, A, A, A, H],
                 id="long-generation-moves-tokens-not-completions"),
    pytest.param([(0, 5, 1, 0, 100), (60, 5, 1, 0, 100)], [A, H], id="tokens-stopped-hung-at-60s"),
])
def test_verdicts(looks, expected):
    assert run(looks) == expected


def test_probe_timeout_comes_from_config():
    config = LivenessConfig(idle_probe_after_s=10, hang_after_s=15, probe_timeout_s=5)
    assert run([(0, 1, 0, 0), (10, 1, 0, 0), (14.9, 1, 0, 0), (15, 1, 0, 0)], config) == [A, P, A, H]


def test_state_is_explicit_and_returned():
    verdict, state = decide(Progress(5, 0, 0), LivenessState(), 100.0, CONFIG)
    assert verdict is A and state == LivenessState(completed_total=5, work_total=0.0, progressed_at_s=100.0)
    verdict, state = decide(Progress(5, 0, 0), state, 130.0, CONFIG)
    assert verdict is P and state.probe_sent_at_s == 130.0


def test_with_nothing_to_probe_with_an_idle_replica_stays_alive_and_a_busy_one_can_still_hang():
    config = LivenessConfig(idle_probe_after_s=10, hang_after_s=15, probe_timeout_s=5)
    state, verdicts = LivenessState(), []
    for now_s, in_flight in ((0, 0), (10, 0), (100, 0), (101, 1), (116, 1)):
        verdict, state = decide(Progress(1, in_flight, 0), state, now_s, config, can_probe=False)
        verdicts.append(verdict)
    assert verdicts == [A, A, A, A, H] and state.probe_sent_at_s is None


@pytest.mark.parametrize("kwargs, message", [
    ({"hang_after_s": 0}, "hang_after_s must be > 0"),
    ({"idle_probe_after_s": 10, "probe_timeout_s": 10, "hang_after_s": 60}, "judged hung sooner"),
])
def test_config_is_checked_when_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LivenessConfig(**kwargs)


def test_the_platform_settings_give_every_replica_its_thresholds_and_refuse_a_contradiction():
    from pydantic import ValidationError

    from controlplane.settings import Settings

    assert Settings.from_env({"MODELPLANE_HOME": "/tmp/mp"}).liveness() == LivenessConfig()
    tuned = Settings.from_env({"MODELPLANE_HOME": "/tmp/mp", "MODELPLANE_LIVENESS_HANG_AFTER_S": "20",
                               "MODELPLANE_LIVENESS_IDLE_PROBE_AFTER_S": "15", "MODELPLANE_LIVENESS_PROBE_TIMEOUT_S": "5",
                               "MODELPLANE_LIVENESS_UNANSWERED_AFTER_S": "10"})
    assert tuned.liveness() == LivenessConfig(hang_after_s=20, idle_probe_after_s=15, probe_timeout_s=5,
                                              unanswered_after_s=10)
    with pytest.raises(ValidationError, match="judged hung sooner"):
        Settings.from_env({"MODELPLANE_HOME": "/tmp/mp", "MODELPLANE_LIVENESS_HANG_AFTER_S": "600"})
    with pytest.raises(ValidationError, match="greater than 0"):
        Settings.from_env({"MODELPLANE_HOME": "/tmp/mp", "MODELPLANE_LIVENESS_UNANSWERED_AFTER_S": "0"})


configs = st.builds(
    lambda idle, hang, extra: LivenessConfig(idle_probe_after_s=idle, hang_after_s=hang,
                                             probe_timeout_s=max(hang - idle, 0) + extra),
    st.floats(1, 100), st.floats(1, 100), st.floats(0.1, 50))
gaps = st.floats(0.01, 0.999)  # as fractions of hang_after_s (1.0 would test float rounding)


@given(configs, st.lists(st.tuples(gaps, st.integers(0, 4), st.integers(0, 200)), min_size=1, max_size=30),
       st.lists(st.floats(0.01, 20), min_size=1, max_size=120))
def test_a_replica_completing_at_least_every_hang_after_s_is_never_hung(config, completions, look_gaps_s):
    """Completions at most hang_after_s apart; looks at arbitrary times; any load."""
    times, t = [], 0.0
    for fraction, _, _ in completions:
        t += fraction * config.hang_after_s
        times.append(t)
    state, now_s = LivenessState(), 0.0
    for gap_s in look_gaps_s:
        now_s += gap_s
        if now_s > times[-1]:
            break  # past the last completion the premise no longer holds
        completed = sum(1 for c in times if c <= now_s)
        index = min(completed, len(completions) - 1)
        _, in_flight, queued = completions[index]
        verdict, state = decide(Progress(completed, in_flight, queued), state, now_s, config)
        assert verdict is not Verdict.HUNG


@given(configs, st.lists(st.floats(0.01, 50), min_size=1, max_size=100))
def test_an_idle_replica_gets_probe_before_it_can_be_hung(config, look_gaps_s):
    state, now_s, verdicts = LivenessState(), 0.0, []
    for gap_s in look_gaps_s:
        now_s += gap_s
        verdict, state = decide(Progress(7, 0, 0), state, now_s, config)
        verdicts.append(verdict)
    not_alive = [v for v in verdicts if v is not Verdict.ALIVE]
    if not_alive:
        assert not_alive[0] is Verdict.PROBE
    # The clock starts at the first look (≤ 50 s) and looks are ≤ 50 s apart: the probe is due by now.
    if now_s >= config.idle_probe_after_s + 100:
        assert Verdict.PROBE in verdicts
