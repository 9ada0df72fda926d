"""The Dagster code location loads and has the documented shape."""

from dagster import Definitions

from pipelines.definitions import defs


def test_definitions_validate():
    Definitions.validate_loadable(defs)


def test_deploy_job_covers_the_deploy_group_partitioned_by_model_version():
    job = defs.resolve_job_def("deploy")
    assert job.partitions_def.name == "model_versions"
    assert {key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()} >= {"source_model"}


def test_registry_sensor_targets_the_deploy_job_and_runs_by_default():
    sensor = defs.resolve_sensor_def("registry_sensor")
    assert sensor.job_name == "deploy"
    assert sensor.default_status.value == "RUNNING"
