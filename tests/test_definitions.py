"""The Dagster code location loads and has the documented shape."""

import pytest
from dagster import Definitions

from pipelines.definitions import defs


def test_definitions_validate():
    Definitions.validate_loadable(defs)


DEPLOY_ASSETS = {"source_model", "quantized_checkpoint", "cost_model", "serving_image", "served_endpoint"}


def test_deploy_job_is_exactly_the_deploy_steps_and_the_gate_partitioned_by_model_version():
    job = defs.resolve_job_def("deploy")
    assert job.partitions_def.name == "model_versions"
    assert {key.to_user_string() for key in job.asset_layer.executable_asset_keys} == DEPLOY_ASSETS
    checks = defs.resolve_asset_graph().asset_check_keys
    assert {(c.asset_key.to_user_string(), c.name) for c in checks} == {("quantized_checkpoint", "eval_gate"),
                                                                              ("served_endpoint", "endpoint_health")}


@pytest.mark.parametrize("name", ["deploy", "remeasure_cost", "rollback"])
def test_each_job_runs_its_steps_in_the_runs_own_process(name):
    """A chain of steps gains nothing from a process per step, and each would cost a start-up."""
    assert defs.resolve_job_def(name).executor_def.name == "in_process"


def test_the_measuring_steps_share_one_pool_and_the_instance_limits_it_to_one():
    from pathlib import Path

    import yaml

    graph = defs.resolve_asset_graph()
    pools = {key.to_user_string(): graph.get(key).pools for key in graph.get_all_asset_keys()}
    assert pools["quantized_checkpoint"] == pools["cost_model"] == {"modelplane-measurement"}
    assert pools["source_model"] == pools["served_endpoint"] == set()
    instance = yaml.safe_load((Path(__file__).parent.parent / "dagster.yaml").read_text())
    assert instance["concurrency"]["pools"]["default_limit"] == 1
    assert instance["run_monitoring"]["enabled"] is True


@pytest.mark.parametrize("instance_yaml", ["dagster.yaml", "deploy/base/dagster.yaml"])
def test_runs_of_one_model_version_take_turns_in_the_queue(instance_yaml, tmp_path, monkeypatch):
    """An alias move reported by both the webhook and the registry sensor starts two runs of one
    partition: the second must wait and find the version served, not race the first for the endpoint."""
    from pathlib import Path

    import yaml
    from dagster import DagsterInstance

    text = (Path(__file__).parent.parent / instance_yaml).read_text()
    config = yaml.safe_load(text)
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump({"concurrency": config["concurrency"]}))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    with DagsterInstance.get() as instance:  # read by Dagster's own loader, as the daemon reads it
        limits = instance.get_concurrency_config().run_queue_config.tag_concurrency_limits
    assert {"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True}, "limit": 1} in limits


@pytest.mark.parametrize("name, job", [("registry_sensor", "deploy"), ("revision_reaper_sensor", None),
                                       ("cost_model_sensor", "remeasure_cost"), ("endpoint_health_sensor", "rollback"),
                                       ("serving_tags_sensor", None)])
def test_every_sensor_runs_by_default(name, job):
    sensor = defs.resolve_sensor_def(name)
    assert sensor.default_status.value == "RUNNING"
    assert (sensor.job_name if sensor.has_jobs else None) == job


def test_the_database_url_is_held_by_the_name_of_its_variable_so_the_ui_never_shows_it(monkeypatch):
    from dagster import EnvVar

    from controlplane.settings import Settings
    from pipelines.definitions import build_resources

    monkeypatch.setenv("MODELPLANE_DATABASE_URL", "postgresql://modelplane:s3cret@db.internal/modelplane")
    resources = build_resources(Settings.from_env())
    for key in ("control_plane", "cluster"):
        assert resources[key].database_url == EnvVar("MODELPLANE_DATABASE_URL")
        assert "s3cret" not in repr(resources[key])


@pytest.mark.parametrize("variable, where, default", [
    ("MODELPLANE_LAYER_CACHE_DIR", lambda r: r["images"].layer_cache(), ("images", "cache")),
    ("MODELPLANE_EVAL_RESULTS_DIR", lambda r: r["model_store"].evaluations_dir(), ("models", "evaluations")),
], ids=["the environment-layer cache", "the eval gate's results"])
def test_a_store_platforms_may_share_is_the_home_s_unless_a_shared_one_is_named(monkeypatch, tmp_path, variable,
                                                                                   where, default):
    from controlplane.settings import Settings
    from pipelines.definitions import build_resources

    monkeypatch.setenv("MODELPLANE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(variable, raising=False)
    assert where(build_resources(Settings.from_env())) == tmp_path.joinpath("home", *default)
    monkeypatch.setenv(variable, str(tmp_path / "shared"))
    assert where(build_resources(Settings.from_env())) == tmp_path / "shared"


def test_a_second_builder_of_one_layer_waits_for_the_first(tmp_path):
    import threading

    from serving.runtime.process import exclusive

    said, entered = [], threading.Event()

    def second():
        with exclusive(tmp_path / "env-pyfunc-abc.lock", said.append, "env-pyfunc-abc"):
            entered.set()

    with exclusive(tmp_path / "env-pyfunc-abc.lock", said.append, "env-pyfunc-abc"):
        waiting = threading.Thread(target=second)
        waiting.start()
        assert not entered.wait(0.5)
        assert said == ["waiting for another process making env-pyfunc-abc"]
    assert entered.wait(10)
    waiting.join()


@pytest.mark.parametrize("reason, may_skip", [
    ("KUBECONFIG does not point at a real cluster", True),
    ("needs a GPU: no CUDA device", True),
    ("PostgreSQL at postgresql+psycopg://postgres@127.0.0.1:5432/postgres is not reachable: refused", False),
    ("mksquashfs (squashfs-tools) missing", False),
    ("FUSE unavailable here: /dev/fuse missing", False),
    ("kubectl (with its built-in Kustomize) is not installed", False),
    ("the Azure trace is not on this machine", False),
])
def test_under_ci_a_test_may_skip_only_for_a_real_cluster_or_a_gpu(reason, may_skip):
    """tests/conftest.py turns every other skip into a failure that names its reason (docs/testing.md)."""
    from tests.conftest import skip_failure_in_ci

    failure = skip_failure_in_ci(reason)
    assert (failure is None) is may_skip
    assert may_skip or reason in failure
