"""The health sensor for real: a new version that fails its bake is rolled back by a Dagster run."""

from __future__ import annotations

import httpx
import pytest
from dagster import DagsterInstance, build_sensor_context

from assets.served_endpoint import RolloutDriver, _roll_out
from controlplane.routers import RouterStore
from pipelines.health import CHECK_NAME, endpoint_health_sensor, rollback_job
from pipelines.resources import ClusterResource, ControlPlaneResource
from benchmarks.autoscale_harness import Platform

pytestmark = pytest.mark.slow
SPEC = ("name: slow\nmodel: models:/slow@champion\nslo: {p99_latency_ms: 2000}\n"
        "scaling: {min_replicas: 1, max_replicas: 1, target_concurrency: 2}\n")


def test_a_version_that_fails_its_bake_is_rolled_back_and_stays_rolled_back(tmp_path):
    from demo.service_time_model import save_service_time_model

    platform = Platform(tmp_path)
    try:
        slow = platform.deploy(SPEC)
        good_id = slow.revision_id
        broken_dir = save_service_time_model(tmp_path / "broken", 1.0, broken=True)
        bad = platform.revisions.create("slow", "slow.v2", str(broken_dir), "pyfunc", {"workers": 1}, 1, {})
        driver = RolloutDriver(platform.cluster, platform.revisions, lambda _m: None,
                               routers=RouterStore(platform.engine))
        assert _roll_out(driver, platform.revisions, "slow", bad.id, 1, good_id).ok
        traffic = {"dataframe_split": {"columns": ["x"], "data": [[2.0]]}}  # not the example: the bug shows
        answers = [httpx.post(slow.url, json=traffic, headers=slow.headers, timeout=30) for _ in range(30)]
        # a 400, as MLflow's server answers what a model raises; marked as the model's fault,
        # since the input passed the model's signature: the version's failure, not the client's
        assert {(a.status_code, a.headers.get("x-modelplane-fault")) for a in answers} == {(400, "model")}

        url = str(platform.engine.url)
        resources = {"control_plane": ControlPlaneResource(database_url=url),
                     "cluster": ClusterResource(database_url=url)}
        instance = DagsterInstance.ephemeral()
        result = endpoint_health_sensor(build_sensor_context(instance=instance, resources=resources))
        [check] = result.asset_events
        assert check.check_name == CHECK_NAME and not check.passed and check.partition == "slow.v2"
        assert "answers failed" in check.description
        [request] = result.run_requests
        assert request.run_key == f"rollback-{bad.id}"

        run = rollback_job.execute_in_process(run_config=request.run_config, resources=resources, instance=instance)
        assert run.success
        serving = platform.revisions.get(platform.revisions.traffic()["slow"])
        assert serving.partition_key == "slow.v1" and serving.details["rollback_of"] == bad.id
        rolled_back = platform.revisions.get(bad.id)
        assert rolled_back.state == "retired" and "failed answers" in rolled_back.details["rolled_back"]
        answer = httpx.post(slow.url, json=traffic, headers=slow.headers, timeout=30)
        assert answer.status_code == 200

        again = endpoint_health_sensor(build_sensor_context(instance=instance, resources=resources))
        assert not again.run_requests  # the fresh revision replaced nothing that a rollback could return to
    finally:
        platform.close()
