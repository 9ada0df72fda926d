"""The registry sensor against a real MLflow registry (SQLite) and a real webhook inbox."""

import json

import pytest
from dagster import DagsterInstance, RunRequest, SkipReason, build_sensor_context

from controlplane.specs import parse_spec
from controlplane.store import EndpointStore, WebhookInbox
from pipelines.resources import ControlPlaneResource, RegistryResource
from pipelines.sensors import registry_sensor


class World:
    """MLflow registry + control-plane database + a Dagster instance, ticked by hand."""

    def __init__(self, mlflow_uri: str, database_url: str, engine) -> None:
        from mlflow import MlflowClient

        self.mlflow = MlflowClient(tracking_uri=mlflow_uri, registry_uri=mlflow_uri)
        self.endpoints = EndpointStore(engine)
        self.inbox = WebhookInbox(engine)
        self.instance = DagsterInstance.ephemeral()
        self.resources = {"control_plane": ControlPlaneResource(database_url=database_url),
                          "registry": RegistryResource(tracking_uri=mlflow_uri)}
        self.cursor = None

    def serve(self, name: str, model: str) -> None:
        self.endpoints.put(parse_spec(f"name: {name}\nmodel: {model}\n"))

    def register(self, model: str) -> str:
        if model not in {m.name for m in self.mlflow.search_registered_models()}:
            self.mlflow.create_registered_model(model)
        return str(self.mlflow.create_model_version(model, source="file:///nowhere").version)

    def tick(self) -> list[RunRequest]:
        context = build_sensor_context(instance=self.instance, cursor=self.cursor, resources=self.resources)
        result = registry_sensor(context)
        if isinstance(result, SkipReason):
            return []
        self.cursor = result.cursor
        for request in result.dynamic_partitions_requests:
            self.instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        return list(result.run_requests)

    def expire_poll_interval(self) -> None:
        state = json.loads(self.cursor)
        state["last_poll_s"] -= 3600
        self.cursor = json.dumps(state)


@pytest.fixture
def world(mlflow_uri, database_url, migrated_engine):
    return World(mlflow_uri, database_url, migrated_engine)


def partitions(requests: list[RunRequest]) -> list[str]:
    assert all(r.run_key == r.partition_key for r in requests), "run_key must be the partition key"
    return [r.partition_key for r in requests]


def test_one_run_request_per_new_version_and_none_on_the_next_tick(world):
    world.serve("gec", "models:/gec@champion")
    world.serve("iris", "models:/iris@champion")
    world.mlflow.set_registered_model_alias("gec", "champion", world.register("gec"))
    world.mlflow.set_registered_model_alias("iris", "champion", world.register("iris"))

    assert sorted(partitions(world.tick())) == ["gec.v1", "iris.v1"]
    assert world.instance.get_dynamic_partitions("model_versions") == ["gec.v1", "iris.v1"]
    assert world.tick() == []
    world.expire_poll_interval()
    assert world.tick() == []


def test_versions_not_behind_the_alias_are_not_deployed(world):
    world.serve("gec", "models:/gec@champion")
    world.register("gec")
    assert world.tick() == []


def test_alias_moved_back_to_an_old_version_does_not_redeploy_it(world):
    world.serve("gec", "models:/gec@champion")
    v1, v2 = world.register("gec"), world.register("gec")
    world.mlflow.set_registered_model_alias("gec", "champion", v1)
    assert partitions(world.tick()) == ["gec.v1"]
    world.mlflow.set_registered_model_alias("gec", "champion", v2)
    world.expire_poll_interval()
    assert partitions(world.tick()) == ["gec.v2"]
    world.mlflow.set_registered_model_alias("gec", "champion", v1)
    world.expire_poll_interval()
    assert world.tick() == []


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
    context = build_sensor_context(instance=world.instance, cursor=None, resources=world.resources)
    result = registry_sensor(context)
    assert isinstance(result, SkipReason)
    assert "registry unavailable" in result.skip_message
    assert [item.delivery_id for item in world.inbox.pending()] == ["d-1"]
