"""The registry sensor against a real MLflow registry (SQLite) and a real webhook inbox."""

import json

import pytest
from dagster import DagsterInstance, DagsterRunStatus, RunRequest, SkipReason, build_sensor_context
from dagster._core.test_utils import create_run_for_test

from controlplane.revisions import RevisionStore
from controlplane.specs import parse_spec
from controlplane.store import EndpointStore, WebhookInbox
from pipelines.resources import ControlPlaneResource, RegistryResource
from pipelines.sensors import registry_sensor


class World:
    """MLflow registry + control-plane database + a Dagster instance, ticked by hand.

    Runs the sensor asks for are not executed: a test says how each one ended
    (:meth:`finish`) and what the endpoint serves afterwards (:meth:`now_serves`).
    """

    def __init__(self, mlflow_uri: str, database_url: str, engine) -> None:
        from mlflow import MlflowClient

        self.mlflow = MlflowClient(tracking_uri=mlflow_uri, registry_uri=mlflow_uri)
        self.endpoints = EndpointStore(engine)
        self.inbox = WebhookInbox(engine)
        self.revisions = RevisionStore(engine)
        self.instance = DagsterInstance.ephemeral()
        self.resources = {"control_plane": ControlPlaneResource(database_url=database_url),
                          "registry": RegistryResource(tracking_uri=mlflow_uri)}
        self.cursor = None

    def serve(self, name: str, model: str, extra: str = "") -> None:
        self.endpoints.put(parse_spec(f"name: {name}\nmodel: {model}\n{extra}"))

    def register(self, model: str) -> str:
        if model not in {m.name for m in self.mlflow.search_registered_models()}:
            self.mlflow.create_registered_model(model)
        return str(self.mlflow.create_model_version(model, source="file:///nowhere").version)

    def tick(self) -> list[RunRequest]:
        """One sensor evaluation; a SkipReason fails the test (use :meth:`evaluate` to expect one)."""
        result = self.evaluate()
        assert not isinstance(result, SkipReason), result.skip_message
        self.cursor = result.cursor
        for request in result.dynamic_partitions_requests:
            self.instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        return list(result.run_requests)

    def evaluate(self):
        context = build_sensor_context(instance=self.instance, cursor=self.cursor, resources=self.resources)
        return registry_sensor(context)

    def finish(self, request: RunRequest, status: DagsterRunStatus, **tags) -> None:
        create_run_for_test(self.instance, job_name="deploy", status=status,
                            tags={**request.tags, "dagster/partition": request.partition_key, **tags})

    def now_serves(self, endpoint: str, partition: str) -> None:
        revision = self.revisions.create(endpoint, partition, "/m", "pyfunc", {}, 1)
        self.revisions.route(endpoint, revision.id)

    def built(self, partition: str, spec_extra: str = "") -> None:
        """Record that a run built the version's checkpoint and cost model under a spec."""
        from dagster import AssetKey, AssetMaterialization

        from pipelines.deploy_plan import checkpoint_sections, cost_sections

        spec = parse_spec(f"name: x\nmodel: models:/m@a\n{spec_extra}")
        for asset, key, value in (("quantized_checkpoint", "checkpoint_sections", checkpoint_sections(spec)),
                                  ("cost_model", "cost_sections", cost_sections(spec))):
            self.instance.report_runless_asset_event(AssetMaterialization(
                AssetKey(asset), partition=partition, metadata={key: value}))

    def alias(self, model: str, version: str) -> None:
        self.mlflow.set_registered_model_alias(model, "champion", version)
        self.inbox.add(f"d-{model}-{version}-{len(self.inbox.pending())}-{id(self)}", "model_version_alias.created",
                       model, "{}")


@pytest.fixture
def world(mlflow_uri, database_url, migrated_engine):
    return World(mlflow_uri, database_url, migrated_engine)


def partitions(requests: list[RunRequest]) -> list[str]:
    return [r.partition_key for r in requests]


def test_a_new_version_behind_the_alias_gets_one_run_which_is_waited_for(world):
    world.serve("gec", "models:/gec@champion")
    world.serve("iris", "models:/iris@champion")
    world.alias("gec", world.register("gec"))
    world.alias("iris", world.register("iris"))

    requests = world.tick()
    assert sorted(partitions(requests)) == ["gec.v1", "iris.v1"]
    assert world.instance.get_dynamic_partitions("model_versions") == ["gec.v1", "iris.v1"]
    assert world.tick() == []  # asked for, not finished: wait
    for request in requests:
        world.finish(request, DagsterRunStatus.SUCCESS)
        world.now_serves(request.partition_key.split(".")[0], request.partition_key)
    assert world.tick() == []  # converged


def test_versions_not_behind_the_alias_are_not_deployed(world):
    world.serve("gec", "models:/gec@champion")
    world.register("gec")
    assert world.tick() == []


def test_moving_the_alias_back_serves_the_old_version_again_reusing_what_was_built(world):
    world.serve("gec", "models:/gec@champion")
    v1, v2 = world.register("gec"), world.register("gec")
    world.now_serves("gec", "gec.v1")
    world.built("gec.v1")
    world.alias("gec", v2)
    [to_v2] = world.tick()
    assert to_v2.partition_key == "gec.v2" and to_v2.asset_selection is None  # built from scratch
    world.finish(to_v2, DagsterRunStatus.SUCCESS)
    world.now_serves("gec", "gec.v2")
    assert world.tick() == []

    world.alias("gec", v1)  # the usual MLflow rollback
    [back] = world.tick()
    assert back.partition_key == "gec.v1"
    assert [key.to_user_string() for key in back.asset_selection] == ["served_endpoint"]  # no second quantization
    assert back.tags["modelplane/reuse"] == "true"


def test_a_version_built_under_other_spec_sections_is_built_again(world):
    world.serve("gec", "models:/gec@champion", "quantization: {scheme: none}\n")
    v1 = world.register("gec")
    world.built("gec.v1")  # under the default quantization section
    world.alias("gec", v1)
    [request] = world.tick()
    assert request.asset_selection is None


def test_a_second_endpoint_on_an_already_served_version_gets_it(world):
    world.serve("gec", "models:/gec@champion")
    world.alias("gec", world.register("gec"))
    [first] = world.tick()
    world.finish(first, DagsterRunStatus.SUCCESS)
    world.now_serves("gec", "gec.v1")
    assert world.tick() == []
    world.serve("gec-eu", "models:/gec@champion")
    [second] = world.tick()
    assert second.partition_key == "gec.v1" and second.tags["modelplane/endpoints"] == "gec-eu"


def test_a_failed_run_is_tried_again_up_to_three_times_and_a_gate_refusal_never(world):
    world.serve("gec", "models:/gec@champion")
    world.serve("iris", "models:/iris@champion")
    world.alias("gec", world.register("gec"))
    world.alias("iris", world.register("iris"))
    attempts = {"gec.v1": 0, "iris.v1": 0}
    for _ in range(8):
        for request in world.tick():
            attempts[request.partition_key] += 1
            refused = {"modelplane/gate": "refused"} if request.partition_key == "iris.v1" else {}
            world.finish(request, DagsterRunStatus.FAILURE, **refused)
    assert attempts == {"gec.v1": 3, "iris.v1": 1}


def test_a_stored_spec_that_no_longer_validates_does_not_stop_the_others(world, migrated_engine):
    from sqlalchemy import update

    from controlplane.schema import EndpointRow

    world.serve("gec", "models:/gec@champion")
    world.serve("iris", "models:/iris@champion")
    with migrated_engine.begin() as connection:
        connection.execute(update(EndpointRow).where(EndpointRow.name == "iris").values(spec={"name": "iris"}))
    world.alias("gec", world.register("gec"))
    assert partitions(world.tick()) == ["gec.v1"]


def test_a_webhook_delivery_triggers_a_lookup_before_the_next_poll(world):
    world.serve("gec", "models:/gec@champion")
    assert world.tick() == []  # first tick polls: nothing registered yet
    world.mlflow.set_registered_model_alias("gec", "champion", world.register("gec"))
    assert world.tick() == []  # poll interval not elapsed, no webhook: not looked up yet
    world.inbox.add("d-1", "model_version_alias.created", "gec", "{}")
    requests = world.tick()
    assert partitions(requests) == ["gec.v1"]
    assert requests[0].tags["modelplane/trigger"] == "webhook"
    assert world.inbox.pending() == []  # drained


def test_an_unreachable_registry_skips_the_tick_and_keeps_the_inbox(world, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # as `modelplane up` sets it, minus the waits
    world.serve("gec", "models:/gec@champion")
    world.inbox.add("d-1", "model_version_alias.created", "gec", "{}")
    world.resources["registry"] = RegistryResource(tracking_uri="http://127.0.0.1:9")
    result = world.evaluate()
    assert isinstance(result, SkipReason)
    assert "registry unavailable" in result.skip_message
    assert [item.delivery_id for item in world.inbox.pending()] == ["d-1"]
