"""cost_model_sensor on a real control-plane database: a serving version without a profile for
this hardware is benchmarked (once per retry period), and one with a profile is left alone."""

from dagster import DagsterInstance, build_sensor_context

from cluster.hardware import detect_local
from controlplane import db
from controlplane.cost_profiles import CostProfileStore
from controlplane.revisions import RevisionStore
from pipelines.cost_sensor import cost_model_sensor
from pipelines.resources import ControlPlaneResource
from tests.conftest import free_port


def tick(database_url: str, cursor: str | None = None):
    resources = {"control_plane": ControlPlaneResource(database_url=database_url,
                                                       router_url=f"http://127.0.0.1:{free_port()}")}  # no router
    context = build_sensor_context(instance=DagsterInstance.ephemeral(), cursor=cursor, resources=resources)
    return cost_model_sensor(context)


def test_a_serving_version_without_a_profile_for_this_hardware_gets_benchmarked(database_url):
    db.upgrade(database_url)
    engine = db.make_engine(database_url)
    revisions = RevisionStore(engine)
    revision = revisions.create("gec", "gec.v3", "/models/gec/v3/quantized", "vllm", {}, 1)
    revisions.route("gec", revision.id)

    result = tick(database_url)
    [request] = result.run_requests
    assert request.partition_key == "gec.v3"
    assert request.tags["modelplane/cost_model_reason"] == f"missing: no cost profile for {detect_local().key}"
    assert tick(database_url, result.cursor).run_requests == []  # not again within the retry period

    CostProfileStore(engine).put("gec.v3", detect_local().key, {"levels": []}, 4, "new version")
    assert tick(database_url).run_requests == []
