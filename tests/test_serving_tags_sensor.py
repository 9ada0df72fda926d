"""When traffic moves outside a deploy run (a rollback, a deleted endpoint), the serving_tags sensor
rewrites the modelplane.serving.* tags of the versions that gained or lost it, on a real MLflow
store (SQLite) and a real control-plane database; an MLflow it cannot reach is retried later."""

import pytest
from dagster import DagsterInstance, build_sensor_context

from controlplane import db
from controlplane.revisions import RevisionStore
from pipelines import version_tags as tags
from pipelines.resources import ControlPlaneResource, RegistryResource
from pipelines.serving_tags_sensor import rewrites, serving_tags_sensor
from tests.conftest import free_port

ROUTER = "http://router.example:8080"


def test_the_first_sync_rewrites_every_serving_version():
    assert [(r.partition_key, r.endpoint) for r in rewrites({}, {"gec": ("gec-v2-a", "gec.v2"),
                                                                    "iris": ("iris-v1-b", "iris.v1")}, {})] == [
        ("gec.v2", "gec"), ("iris.v1", "iris")]


def test_a_move_rewrites_the_version_that_gained_and_the_one_that_lost_saying_what_replaced_it():
    moved = rewrites({"gec": ("gec-v2-a", "gec.v2")}, {"gec": ("gec-v1-c", "gec.v1")}, {"gec": "2026-12-02T06:00:00"})
    reasons = {r.partition_key: r.reason_if_none for r in moved}
    assert reasons["gec.v2"] == "replaced by gec.v1 on gec at 2026-12-02T06:00:00"
    assert [r.partition_key for r in moved] == ["gec.v1", "gec.v2"]


def test_nothing_moved_nothing_rewritten_and_a_new_revision_of_the_same_version_rewrites_only_it():
    assert rewrites({"gec": ("gec-v2-a", "gec.v2")}, {"gec": ("gec-v2-a", "gec.v2")}, {}) == []
    assert [r.partition_key for r in rewrites({"gec": ("gec-v2-a", "gec.v2")}, {"gec": ("gec-v2-b", "gec.v2")}, {})] \
        == ["gec.v2"]


def test_an_endpoint_without_traffic_any_more_leaves_its_version_not_serving_with_the_reason():
    [gone] = rewrites({"gec": ("gec-v2-a", "gec.v2")}, {}, {})
    assert gone.partition_key == "gec.v2"
    assert gone.reason_if_none == "gec routes to no revision any more (deleted or drained)"


@pytest.fixture
def stores(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("gec")
    for _ in range(2):
        client.create_model_version("gec", source=str(tmp_path))
    database_url = f"sqlite:///{tmp_path / 'controlplane.db'}"
    db.upgrade(database_url)
    engine = db.make_engine(database_url)
    yield uri, client, database_url, RevisionStore(engine)
    engine.dispose()


def tick(database_url: str, tracking_uri: str, cursor: str | None):
    context = build_sensor_context(instance=DagsterInstance.ephemeral(), cursor=cursor, resources={
        "control_plane": ControlPlaneResource(database_url=database_url, router_url=ROUTER),
        "registry": RegistryResource(tracking_uri=tracking_uri)})
    result = serving_tags_sensor(context)
    return result, context.cursor


def serving(client, version: str) -> dict:
    page = client.get_model_version("gec", version).tags
    return {k: v for k, v in page.items() if k.startswith("modelplane.serving.")}


def test_a_rollback_outside_a_run_moves_the_serving_tags_to_the_version_it_restored(stores):
    uri, client, database_url, revisions = stores
    v1 = revisions.create("gec", "gec.v1", "/models/gec/1", "pyfunc", {}, 1)
    v2 = revisions.create("gec", "gec.v2", "/models/gec/2", "pyfunc", {}, 1)
    revisions.route("gec", v2.id)
    _, cursor = tick(database_url, uri, None)
    assert serving(client, "2")[tags.SERVING_STATE] == "serving" and serving(client, "1") == {}

    revisions.route("gec", v1.id)  # what the health sensor's rollback run does
    result, cursor = tick(database_url, uri, cursor)
    assert "gec.v1" in result.skip_message and "gec.v2" in result.skip_message
    restored, replaced = serving(client, "1"), serving(client, "2")
    assert (restored[tags.SERVING_STATE], restored[tags.SERVING_ENDPOINT], restored[tags.SERVING_REVISION]) == (
        "serving", "gec", v1.id)
    assert restored[tags.SERVING_URL] == f"{ROUTER}/serving-endpoints/gec/invocations"
    assert replaced[tags.SERVING_STATE] == "not serving"
    assert replaced[tags.SERVING_REASON].startswith("replaced by gec.v1 on gec at ")
    assert tags.SERVING_ENDPOINT not in replaced

    result, _ = tick(database_url, uri, cursor)
    assert result.skip_message == "every version's serving tags match the traffic"


def test_a_move_seen_while_mlflow_is_unreachable_is_written_once_it_answers(stores, monkeypatch):
    uri, client, database_url, revisions = stores
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    v1 = revisions.create("gec", "gec.v1", "/models/gec/1", "pyfunc", {}, 1)
    v2 = revisions.create("gec", "gec.v2", "/models/gec/2", "pyfunc", {}, 1)
    revisions.route("gec", v2.id)
    _, cursor = tick(database_url, uri, None)

    revisions.route("gec", v1.id)
    result, cursor = tick(database_url, f"http://127.0.0.1:{free_port()}", cursor)  # nothing listens there
    assert "will retry gec.v1, gec.v2" in result.skip_message
    assert serving(client, "2")[tags.SERVING_STATE] == "serving"  # unchanged until MLflow answers

    result, _ = tick(database_url, uri, cursor)
    assert serving(client, "1")[tags.SERVING_STATE] == "serving"
    assert serving(client, "2")[tags.SERVING_STATE] == "not serving"
