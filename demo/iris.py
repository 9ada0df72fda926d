"""The "iris" demo model: a scikit-learn classifier, the smallest model a data scientist logs.

It exercises the non-LLM path of modelplane (pyfunc on a DataFrame) with a real MLflow
signature, trained in milliseconds on the iris data that scikit-learn ships.
"""

from __future__ import annotations

import mlflow
import pandas as pd
from mlflow.entities.model_registry import ModelVersion
from mlflow.models import infer_signature
from sklearn.datasets import load_iris
from sklearn.linear_model import LogisticRegression

from demo.registry import experiment_id, registered_version, using_tracking_uri

IRIS_DESCRIPTION = "iris species classifier (scikit-learn LogisticRegression, BSD-3-Clause data)"
RANDOM_STATE = 0


def train_iris() -> tuple[LogisticRegression, pd.DataFrame, pd.Series]:
    """Fit the classifier on all 150 iris rows; returns (model, features, target)."""
    data = load_iris(as_frame=True)
    features, target = data.data, data.target
    model = LogisticRegression(max_iter=500, random_state=RANDOM_STATE).fit(features, target)
    return model, features, target


def log_iris(tracking_uri: str, registered_model_name: str = "iris") -> ModelVersion:
    """Train the iris classifier, log it with its signature and register a new version."""
    model, features, target = train_iris()
    with using_tracking_uri(tracking_uri) as client:
        with mlflow.start_run(
            experiment_id=experiment_id(client), run_name=registered_model_name, description=IRIS_DESCRIPTION
        ):
            mlflow.log_metric("train_accuracy", model.score(features, target))
            info = mlflow.sklearn.log_model(
                model,
                name="model",
                signature=infer_signature(features, target),
                input_example=features.head(3),
                serialization_format=mlflow.sklearn.SERIALIZATION_FORMAT_SKOPS,
                # Explicit, because inferring them runs a subprocess (~10 s) and collects every
                # package the calling process has imported (torch, pytest, ...).
                pip_requirements=mlflow.sklearn.get_default_pip_requirements(include_skops=True),
                registered_model_name=registered_model_name,
            )
        return registered_version(client, info, registered_model_name, IRIS_DESCRIPTION)
