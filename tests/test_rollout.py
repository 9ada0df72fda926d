"""Rolling out a revision: the decision generator alone, then driven against a fake cluster."""

import pytest

from assets.rollout import Drain, Retire, RolloutResult, Route, Start, StillCurrent, Superseded, WaitReady, rollout
from assets.served_endpoint import RolloutDriver, choose_runtime
from cluster.fake import InMemoryCluster
from controlplane.revisions import RevisionStore
from controlplane.specs import Runtime


def drive(flow, answers: dict) -> tuple[list, RolloutResult]:
    """Step through a rollout by hand, answering each action type from ``answers``."""
    actions, reply = [], None
    try:
        while True:
            action = flow.send(reply)
            actions.append(action)
            reply = answers.get(type(action))
    except StopIteration as stop:
        return actions, stop.value


def test_first_rollout_starts_waits_and_routes():
    actions, result = drive(rollout("gec", "r2", 1), {WaitReady: True, StillCurrent: True, Route: None})
    assert actions == [Start("r2", 1), WaitReady("r2", 1), StillCurrent("gec"), Route("gec", "r2")]
    assert result == RolloutResult(ok=True, revision_id="r2")


def test_replacing_a_revision_drains_and_retires_the_old_one_after_routing():
    actions, result = drive(rollout("gec", "r2", 2), {WaitReady: True, StillCurrent: True, Route: "r1"})
    assert actions == [Start("r2", 2), WaitReady("r2", 2), StillCurrent("gec"), Route("gec", "r2"), Drain("r1"),
                       Retire("r1")]
    assert result.previous_revision_id == "r1"


def test_a_revision_that_never_gets_ready_is_retired_and_traffic_never_moves():
    actions, result = drive(rollout("gec", "r2", 1), {WaitReady: False})
    assert actions == [Start("r2", 1), WaitReady("r2", 1), Retire("r2")]
    assert not result.ok
    assert "keeps its current revision" in result.reason


def test_a_rollout_overtaken_by_a_newer_version_retires_itself_and_leaves_traffic_alone():
    actions, result = drive(rollout("gec", "r3", 1), {WaitReady: True, StillCurrent: False})
    assert actions == [Start("r3", 1), WaitReady("r3", 1), StillCurrent("gec"), Retire("r3")]
    assert result.superseded and not result.ok
    assert not any(isinstance(a, Route) for a in actions)


@pytest.mark.parametrize("requested, is_llm, expected", [
    (Runtime.auto, True, "vllm"), (Runtime.auto, False, "pyfunc"), (Runtime.pyfunc, True, "pyfunc")])
def test_runtime_follows_the_model_unless_the_spec_says_otherwise(requested, is_llm, expected):
    assert choose_runtime(requested, is_llm) == expected


def test_driver_moves_traffic_and_retires_the_old_revision(migrated_engine, monkeypatch):
    cluster, store = InMemoryCluster(), RevisionStore(migrated_engine)
    driver = RolloutDriver(cluster, store, log=lambda _m: None, poll_s=0.01)
    monkeypatch.setattr(RolloutDriver, "_drain", lambda self, rid: store.set_state(rid, "draining"))
    old = store.create("gec", "gec.v1", "/models/gec/v1", "vllm", {}, 1)
    assert driver.run(rollout("gec", old.id, 1)).ok
    new = store.create("gec", "gec.v2", "/models/gec/v2", "vllm", {}, 2)
    result = driver.run(rollout("gec", new.id, 2, expected_previous=old.id))

    assert result == RolloutResult(ok=True, revision_id=new.id, previous_revision_id=old.id)
    assert store.traffic() == {"gec": new.id}
    assert (store.get(old.id).state, store.get(new.id).state) == ("retired", "serving")
    assert [r.replica_id for r in cluster.replicas()] == [f"{new.id}-0", f"{new.id}-1"]


def test_driver_gives_up_on_a_revision_that_stays_unready(migrated_engine):
    cluster, store = InMemoryCluster(ready_on_start=False), RevisionStore(migrated_engine)
    driver = RolloutDriver(cluster, store, log=lambda _m: None, wait_ready_timeout_s=0.2, poll_s=0.01)
    revision = store.create("gec", "gec.v1", "/models/gec/v1", "vllm", {}, 1)
    result = driver.run(rollout("gec", revision.id, 1))
    assert not result.ok
    assert store.traffic() == {}
    assert store.get(revision.id).state == "failed"
    assert cluster.replicas() == []


def test_a_rollout_that_lost_the_race_for_the_traffic_retires_its_revision(migrated_engine, monkeypatch):
    cluster, store = InMemoryCluster(), RevisionStore(migrated_engine)
    driver = RolloutDriver(cluster, store, log=lambda _m: None, poll_s=0.01)
    monkeypatch.setattr(RolloutDriver, "_drain", lambda self, rid: store.set_state(rid, "draining"))
    old = store.create("gec", "gec.v1", "/m", "vllm", {}, 1)
    driver.run(rollout("gec", old.id, 1))
    slow = store.create("gec", "gec.v2", "/m", "vllm", {}, 1)  # began while v1 served …
    fast = store.create("gec", "gec.v3", "/m", "vllm", {}, 1)
    assert driver.run(rollout("gec", fast.id, 1, expected_previous=old.id)).ok  # … v3 routed first
    result = driver.run(rollout("gec", slow.id, 1, expected_previous=old.id))
    assert result.superseded and not result.ok and fast.id in result.reason
    assert store.traffic() == {"gec": fast.id}
    assert store.get(slow.id).state == "retired"
    assert [r.revision_id for r in cluster.replicas()] == [fast.id]


def test_drive_a_superseded_switch_by_hand():
    actions, result = drive(rollout("gec", "r3", 1, expected_previous="r1"),
                            {WaitReady: True, StillCurrent: True, Route: Superseded("r2")})
    assert actions[-2:] == [Route("gec", "r3", "r1"), Retire("r3")]
    assert result.superseded and "r2" in result.reason
