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


def _pipeline():
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(max_iter=500)).fit(*load_iris(return_X_y=True))


def _fitted_estimators():
    """Estimators of the shapes scikit-learn models take: plain, pipelines (one with a passthrough
    step), ensembles (a list of trees, an object array of trees), a search, string labels."""
    import numpy as np
    from sklearn.datasets import load_iris
    from sklearn.ensemble import BaggingClassifier, GradientBoostingClassifier, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GridSearchCV
    from sklearn.pipeline import Pipeline

    X, y = load_iris(return_X_y=True)
    names = np.array(["setosa", "versicolor", "virginica"], dtype=object)[y]
    return {
        "logistic": LogisticRegression(max_iter=500).fit(X, y),
        "pipeline": _pipeline(),
        "passthrough": Pipeline([("scale", "passthrough"), ("model", LogisticRegression(max_iter=500))]).fit(X, y),
        "forest": RandomForestClassifier(n_estimators=3, random_state=0).fit(X, y),
        "boosting": GradientBoostingClassifier(n_estimators=2, random_state=0).fit(X, y),
        "bagging": BaggingClassifier(LogisticRegression(max_iter=500), n_estimators=2, random_state=0).fit(X, y),
        "search": GridSearchCV(LogisticRegression(max_iter=500), {"C": [0.5, 1.0]}, cv=2).fit(X, y),
        "string labels": LogisticRegression(max_iter=500).fit(X, names),
    }


def test_a_skops_file_is_counted_from_its_schema_as_the_loaded_estimator_is(tmp_path):
    import skops.io

    from assets.model_files import skops_parameter_count

    for name, estimator in _fitted_estimators().items():
        path = tmp_path / f"{name.replace(' ', '-')}.skops"
        skops.io.dump(estimator, path)
        assert skops_parameter_count(path) == estimator_parameter_count(estimator) > 0, name


@pytest.fixture(scope="module")
def skops_model(tmp_path_factory) -> Path:
    """A pipeline of 31 learned numbers saved by MLflow with skops, as ``demo.iris`` logs iris."""
    import mlflow.sklearn

    path = tmp_path_factory.mktemp("skops") / "model"
    mlflow.sklearn.save_model(_pipeline(), path, serialization_format="skops", pip_requirements=["scikit-learn"])
    return path


def test_describing_a_skops_model_loads_neither_skops_nor_scikit_learn(skops_model):
    """The point of reading the schema: the first deploy step imported every scikit-learn module
    (and torch) to count 19 numbers."""
    import subprocess
    import sys

    probe = ("import sys; from pathlib import Path; from assets.model_files import describe;"
             f"print(describe(Path({str(skops_model)!r})).parameter_count,"
             " sorted(m for m in ('skops', 'sklearn', 'torch', 'mlflow') if m in sys.modules))")
    described = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert described.stdout.split(maxsplit=1) == ["31", "[]\n"]


def test_a_schema_it_cannot_follow_is_counted_by_loading_the_model(skops_model, monkeypatch):
    from assets import model_files

    def unreadable(path):
        raise model_files.UnreadableSchema("a ReduceNode where an estimator was expected")

    monkeypatch.setattr(model_files, "skops_parameter_count", unreadable)
    assert model_files.describe(skops_model).parameter_count == 31
