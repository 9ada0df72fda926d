"""A model logged with neither a signature nor an input example deploys, as `mlflow models serve`
serves it: ready once loaded, and not measured, with a warning that says how to have it measured."""

from __future__ import annotations

import httpx
import pytest

from controlplane.specs import parse_spec
from tests.deploy_harness import Deployment

pytestmark = pytest.mark.slow

SPEC = "name: plain\nmodel: models:/plain@champion\nscaling: {min_replicas: 1, max_replicas: 1}\n"


def log_plain_model(deployment: Deployment) -> str:
    """A scikit-learn classifier logged as a new user might: no signature, no input example."""
    import mlflow
    import mlflow.sklearn
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    X, y = load_iris(return_X_y=True)
    mlflow.set_tracking_uri(deployment.uri)
    mlflow.set_experiment("modelplane-demo")
    with mlflow.start_run():
        info = mlflow.sklearn.log_model(LogisticRegression(max_iter=300).fit(X[:, :2], y), name="model",
                                        registered_model_name="plain")
    version = str(info.registered_model_version)
    deployment.mlflow.set_registered_model_alias("plain", "champion", version)
    return version


def test_a_model_logged_with_neither_a_signature_nor_an_example_deploys_unmeasured_and_serves(tmp_path):
    deployment = Deployment(tmp_path)
    try:
        deployment.specs.put(parse_spec(SPEC))
        version = log_plain_model(deployment)
        result = deployment.deploy(version, model="plain")
        assert result.success, [e.message for e in result.all_events if e.is_failure]
        measured = result.asset_materializations_for_node("cost_model")[0].metadata
        assert measured["measured"].value is False and "Log the model with input_example" in measured["warning"].value
        assert result.output_for_node("cost_model")["target_concurrency"] == 1.0
        revision = deployment.serving_revision("plain")
        [replica] = [r for r in deployment.cluster().replicas(revision.id) if r.ready]
        answer = httpx.post(f"{replica.url}/invocations", json={"inputs": [[5.1, 3.5], [6.3, 3.3]]}, timeout=30)
        assert answer.status_code == 200 and len(answer.json()["predictions"]) == 2
        wrong = httpx.post(f"{replica.url}/invocations", json={"inputs": [[5.1]]}, timeout=30)
        assert wrong.status_code == 400 and "x-modelplane-fault" not in wrong.headers  # no signature: no blame
    finally:
        deployment.close()


def test_the_spec_can_name_the_example_the_cost_sweep_sends(tmp_path):
    """cost_model.example takes the place of the input example the model was logged without."""
    deployment = Deployment(tmp_path)
    try:
        deployment.specs.put(parse_spec(SPEC + "cost_model: {example: {inputs: [[5.1, 3.5]]}, concurrency: [1, 2], "
                                               "requests_per_point: 4, max_point_s: 2}\n"))
        result = deployment.deploy(log_plain_model(deployment), model="plain")
        assert result.success, [e.message for e in result.all_events if e.is_failure]
        measured = result.output_for_node("cost_model")
        assert measured["cost_model"] is not None and measured["target_concurrency"] in (1, 2)
        assert "measured" not in result.asset_materializations_for_node("cost_model")[0].metadata
    finally:
        deployment.close()
