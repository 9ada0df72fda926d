"""Revisions nothing needs any more are retired: the pure rule, then the sensor on a real database."""

from datetime import datetime, timedelta, timezone

import pytest
from dagster import DagsterInstance, DagsterRunStatus, build_sensor_context
from dagster._core.test_utils import create_run_for_test

from pipelines.reaper import Owned, orphans

T = datetime(2027, 1, 15, 8, 0, tzinfo=timezone.utc)
LATER = T + timedelta(minutes=5)


@pytest.mark.parametrize("revision, routed, live, retired", [
    (Owned("r", "ready", "run-1", T), set(), set(), True),  # started, never routed, its run died
    (Owned("r", "ready", "run-1", T), set(), {"run-1"}, False),  # its run is still rolling it out
    (Owned("r", "serving", "run-1", T), {"r"}, set(), False),  # an endpoint routes to it
    (Owned("r", "draining", "run-1", T), set(), set(), True),  # replaced, its drain never finished
    (Owned("r", "pending", None, T), set(), set(), True),  # no owner recorded
    (Owned("r", "retired", None, T), set(), set(), False),  # already retired
    (Owned("r", "ready", None, LATER - timedelta(seconds=30)), set(), set(), False),  # too fresh: grace
])
def test_a_revision_is_retired_when_nothing_routes_to_it_and_no_live_run_owns_it(revision, routed, live, retired):
    assert orphans([revision], routed, live, LATER) == (["r"] if retired else [])


def test_the_reaper_sensor_retires_what_a_dead_run_left_and_spares_the_rest(migrated_engine, database_url):
    from sqlalchemy import update

    from controlplane.revisions import RevisionStore
    from controlplane.schema import RevisionRow
    from controlplane.splits import Share, SplitStore
    from pipelines.resources import ClusterResource, ControlPlaneResource
    from pipelines.sensors import revision_reaper_sensor

    instance = DagsterInstance.ephemeral()
    live = create_run_for_test(instance, job_name="deploy", status=DagsterRunStatus.STARTED)
    dead = create_run_for_test(instance, job_name="deploy", status=DagsterRunStatus.FAILURE)
    revisions = RevisionStore(migrated_engine)
    serving = revisions.create("gec", "gec.v1", "/m", "vllm", {}, 1, {"run_id": dead.run_id})
    revisions.route("gec", serving.id)
    left = revisions.create("gec", "gec.v2", "/m", "vllm", {}, 1, {"run_id": dead.run_id})
    rolling = revisions.create("gec", "gec.v3", "/m", "vllm", {}, 1, {"run_id": live.run_id})
    # a canary whose rollout died mid-phase, and a revision a person mirrors traffic to
    canary = revisions.create("gec", "gec.v4", "/m", "vllm", {}, 1, {"run_id": dead.run_id, "canary_phase": True})
    mirrored = revisions.create("gec", "gec.v5", "/m", "vllm", {}, 1, {"run_id": dead.run_id})
    splits = SplitStore(migrated_engine)
    splits.set("gec", canary=Share(canary.id, 10.0), shadow=Share(mirrored.id, 20.0))
    with migrated_engine.begin() as connection:  # all three were last touched ten minutes ago
        connection.execute(update(RevisionRow).values(updated_at=datetime.now(timezone.utc) - timedelta(minutes=10)))

    context = build_sensor_context(instance=instance, resources={
        "control_plane": ControlPlaneResource(database_url=database_url),
        "cluster": ClusterResource(database_url=database_url)})
    result = revision_reaper_sensor(context)
    assert "retired 2" in result.skip_message
    assert [revisions.get(r.id).state for r in (serving, left, rolling, canary, mirrored)] == \
        ["pending", "retired", "pending", "retired", "pending"]
    assert splits.get("gec").canary is None and splits.get("gec").shadow == Share(mirrored.id, 20.0)
    assert revisions.get(left.id).desired_replicas == 0
