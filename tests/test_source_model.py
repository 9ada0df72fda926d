"""source_model: a registered version is downloaded and described, for an LLM and a classic model."""

from pathlib import Path

import pytest
from dagster import DagsterInstance, materialize

from assets.model_files import estimator_parameter_count, safetensors_parameter_count
from assets.source_model import source_model
from pipelines.resources import ModelStoreResource, RegistryResource


@pytest.fixture
def registry_uri(mlflow_uri, tmp_path) -> str:
    from mlflow import MlflowClient

    # The demo loggers use this experiment; keep its artifacts in tmp_path.
    MlflowClient(tracking_uri=mlflow_uri).create_experiment(
        "modelplane-demo", artifact_location=(tmp_path / "artifacts").as_uri())
    return mlflow_uri


def materialize_version(uri: str, store: Path, key: str):
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("model_versions", [key])
    result = materialize(
        [source_model], partition_key=key, instance=instance,
        resources={"registry": RegistryResource(tracking_uri=uri), "model_store": ModelStoreResource(root_dir=str(store))},
    )
    assert result.success
    [event] = result.get_asset_materialization_events()
    metadata = {k: v.value for k, v in event.materialization.metadata.items()}
    return result.output_for_node("source_model"), metadata


def test_tiny_llm_is_downloaded_and_described(registry_uri, tmp_path, tiny_llama):
    from demo.tiny_llama import log_tiny_llama

    checkpoint = tiny_llama(tmp_path / "tiny")
    log_tiny_llama(registry_uri, checkpoint, registered_model_name="tiny-llm")
    expected_parameters = sum(safetensors_parameter_count(p) for p in checkpoint.glob("*.safetensors"))

    value, metadata = materialize_version(registry_uri, tmp_path / "store", "tiny-llm.v1")

    assert metadata["flavor"] == "transformers"
    assert metadata["kind"] == "llm"
    assert metadata["parameter_count"] == expected_parameters > 0
    assert metadata["size_bytes"] > expected_parameters * 4 * 0.9  # float32 weights are most of it
    assert "messages" in str(metadata["signature"]["inputs"])  # chat-shaped
    assert Path(value["local_dir"]) == tmp_path / "store" / "tiny-llm" / "v1" / "source"
    assert (Path(value["local_dir"]) / "MLmodel").exists()


def test_sklearn_model_is_downloaded_and_described(registry_uri, tmp_path):
    from demo.iris import log_iris

    log_iris(registry_uri, registered_model_name="iris")

    value, metadata = materialize_version(registry_uri, tmp_path / "store", "iris.v1")

    assert metadata["flavor"] == "sklearn"
    assert metadata["kind"] == "classic"
    # LogisticRegression on iris: coef_ 3×4, intercept_ 3, classes_ 3, n_iter_ 1
    assert metadata["parameter_count"] == 19
    columns = [c["name"] for c in metadata["signature"]["inputs"]]
    assert columns == ["sepal length (cm)", "sepal width (cm)", "petal length (cm)", "petal width (cm)"]
    assert value["is_llm"] is False


def test_an_unregistered_version_fails_the_step_with_its_name(registry_uri, tmp_path):
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("model_versions", ["ghost.v4"])
    result = materialize(
        [source_model], partition_key="ghost.v4", instance=instance, raise_on_error=False,
        resources={"registry": RegistryResource(tracking_uri=registry_uri),
                   "model_store": ModelStoreResource(root_dir=str(tmp_path / "store"))},
    )
    assert not result.success
    [failure] = result.get_step_failure_events()
    assert "ghost version 4 is not registered" in str(failure.step_failure_data.user_failure_data.description)
    assert not [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]  # a decision: not retried
    assert not (tmp_path / "store" / "ghost").exists()


def test_safetensors_header_counts_elements(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2, 3), "b": torch.zeros(4)}, tmp_path / "w.safetensors")
    assert safetensors_parameter_count(tmp_path / "w.safetensors") == 10


def test_estimator_parameters_are_counted_through_pipelines():
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    X, y = load_iris(return_X_y=True)
    pipeline = make_pipeline(StandardScaler(), LogisticRegression(max_iter=500)).fit(X, y)
    scaler = 4 + 4 + 4  # mean_, var_, scale_ (n_samples_seen_ is a scalar)
    assert estimator_parameter_count(pipeline) == scaler + 19
