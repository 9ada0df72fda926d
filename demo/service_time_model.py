"""A pyfunc model with a known service time: the autoscaler's tests and benchmark drive it.

Each row costs ``service_time_ms`` of waiting inside ``predict``, so a replica's capacity is
known exactly (1,000 / service_time_ms rows per second per worker) and does not depend on
how busy the 2 shared cores are. The autoscaler is what is measured with it — how fast
replicas are added and removed, what the p99 does meanwhile — not the model; DESIGN.md and
issue 11 name it "the pyfunc runtime with an injected service time".
"""

from __future__ import annotations

import time
from pathlib import Path

import mlflow
import pandas as pd


EXAMPLE_X = 1.0


class ServiceTimeModel(mlflow.pyfunc.PythonModel):
    def __init__(self, service_time_ms: float, broken: bool = False) -> None:
        self.service_time_ms = service_time_ms
        # A bad version for the health check's rollback test: it answers its input example (so it
        # passes the warm-up and becomes ready) and raises on every other input, as a model bug would.
        self.broken = broken

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        time.sleep(self.service_time_ms / 1000 * len(model_input))
        if self.broken and not (model_input["x"] == EXAMPLE_X).all():
            raise RuntimeError("this version is broken on purpose")
        return pd.DataFrame({"served": [1] * len(model_input)})


def save_service_time_model(path: Path, service_time_ms: float, broken: bool = False) -> Path:
    """Write the model as an MLflow model directory at ``path`` and return it."""
    example = pd.DataFrame({"x": [EXAMPLE_X]})
    mlflow.pyfunc.save_model(str(path), python_model=ServiceTimeModel(service_time_ms, broken), input_example=example)
    return path
