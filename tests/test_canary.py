"""A rollout's canary phase: the decision in the generator, the judgement, and the phase run
against the real control-plane database with the routers' load faked (no waiting)."""

from dataclasses import dataclass, field

import pytest

from assets.canary import CanaryPhase, Tally, judge
from assets.rollout import (Canary, CanaryPlan, CanaryVerdict, Drain, Retire, Route, Start, StillCurrent, WaitReady,
                            rollout)
from assets.served_endpoint import RolloutDriver
from cluster.fake import InMemoryCluster
from controlplane.revisions import RevisionStore
from controlplane.splits import SplitStore
from tests.test_rollout import drive

PLAN = CanaryPlan(percent=10.0, duration_s=90.0, slo_p99_ms=1000.0, max_error_increase=0.01, max_p99_ratio=1.2)


def test_a_passing_canary_comes_before_the_switch():
    answers = {WaitReady: True, StillCurrent: True, Canary: CanaryVerdict(True, "fine"), Route: "r1"}
    actions, result = drive(rollout("gec", "r2", 1, expected_previous="r1", canary=PLAN), answers)
    assert [type(a) for a in actions] == [Start, WaitReady, StillCurrent, Canary, StillCurrent, Route, Drain, Retire]
    assert actions[3] == Canary("gec", "r2", "r1", PLAN)
    assert result.ok and actions[-1] == Retire("r1")


def test_a_failed_canary_retires_the_new_revision_and_traffic_never_moves():
    answers = {WaitReady: True, StillCurrent: True, Canary: CanaryVerdict(False, "5% errors")}
    actions, result = drive(rollout("gec", "r2", 1, expected_previous="r1", canary=PLAN), answers)
    assert [type(a) for a in actions] == [Start, WaitReady, StillCurrent, Canary, Drain, Retire]
    assert actions[-2:] == [Drain("r2"), Retire("r2")]
    assert not result.ok and "5% errors" in result.reason


def test_a_first_rollout_has_nothing_to_compare_with_and_switches_at_once():
    actions, _ = drive(rollout("gec", "r1", 1, canary=PLAN), {WaitReady: True, StillCurrent: True, Route: None})
    assert Canary not in [type(a) for a in actions]


@pytest.mark.parametrize("canary, serving, ok, words", [
    (Tally(0, 0, None), Tally(500, 5, 200.0), True, "no request reached the canary"),
    (Tally(100, 1, 250.0), Tally(900, 9, 240.0), True, "answered 100 requests"),
    (Tally(100, 3, 250.0), Tally(900, 9, 240.0), False, "more than 1.0 points worse"),
    (Tally(100, 0, 1500.0), Tally(900, 0, 300.0), False, "over the SLO"),
    (Tally(100, 0, 1500.0), Tally(900, 0, 1400.0), True, "answered"),  # both slow: not the canary's fault
    (Tally(100, 0, 900.0), Tally(900, 0, 300.0), True, "answered"),  # 3× slower, but within the SLO
])
def test_the_canary_is_judged_on_its_errors_and_its_p99(canary, serving, ok, words):
    verdict, reason = judge(canary, serving, slo_p99_ms=1000.0, max_error_increase=0.01, max_p99_ratio=1.2)
    assert verdict is ok and words in reason


def test_windows_add_answers_and_keep_the_highest_p99():
    tally = Tally().add(200.0, 10, 1).add(None, 0, 0).add(350.0, 5, 0)
    assert tally == Tally(15, 1, 350.0)


@dataclass
class FakeTime:
    now: float = 0.0
    slept: list = field(default_factory=list)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@dataclass
class Load:
    by_revision: dict


def phase_setup(engine):
    store = RevisionStore(engine)
    old = store.create("gec", "gec.v1", "/m/1", "vllm", {}, 1)
    new = store.create("gec", "gec.v2", "/m/2", "vllm", {}, 1)
    store.set_state(new.id, "ready")
    store.route("gec", old.id)
    return store, old.id, new.id


def test_the_phase_sets_the_split_reads_each_window_and_clears_it(migrated_engine):
    _, old, new = phase_setup(migrated_engine)
    splits, clock, seen = SplitStore(migrated_engine), FakeTime(), []

    def read_load():
        seen.append(splits.get("gec").canary)  # the canary takes its share while the windows are read
        return {"gec": Load({new: (300.0, 10, 2), old: (250.0, 90, 0)})}

    verdict = CanaryPhase(splits, read_load, log=lambda _m: None, sleep=clock.sleep, monotonic=lambda: clock.now)(
        Canary("gec", new, old, CanaryPlan(10.0, 75.0, 1000.0, 0.01, 1.2)))
    assert clock.slept == [30.0, 30.0, 15.0]
    assert all(share.revision_id == new and share.percent == 10.0 for share in seen)
    assert not verdict.ok and "6 of 30" in verdict.reason
    assert splits.get("gec").canary is None


def test_the_driver_runs_a_canary_then_switches(migrated_engine, monkeypatch):
    store, old, _ = phase_setup(migrated_engine)
    store.set_state(old, "serving")
    candidate = store.create("gec", "gec.v3", "/m/3", "vllm", {}, 1)
    clock = FakeTime()
    phase = CanaryPhase(SplitStore(migrated_engine), lambda: {}, log=lambda _m: None, sleep=clock.sleep,
                        monotonic=lambda: clock.now)
    driver = RolloutDriver(InMemoryCluster(), store, log=lambda _m: None, poll_s=0.01, canary=phase)
    monkeypatch.setattr(RolloutDriver, "_drain", lambda self, rid: store.set_state(rid, "draining"))
    result = driver.run(rollout("gec", candidate.id, 1, expected_previous=old, canary=PLAN))
    assert result.ok and store.traffic() == {"gec": candidate.id}
    assert sum(clock.slept) == PLAN.duration_s
    assert SplitStore(migrated_engine).get("gec").canary is None
