"""Describing a downloaded MLflow model directory: flavor, signature, parameters, size."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import yaml

#: MLflow flavors served as LLMs by the vLLM runtime; every other model is "classic".
LLM_FLAVORS = ("transformers",)


@dataclass(frozen=True)
class ModelDescription:
    flavor: str  # the model's own flavor, e.g. "transformers" or "sklearn" (not "python_function")
    flavors: tuple[str, ...]
    is_llm: bool
    parameter_count: int | None
    signature: dict | None
    size_bytes: int
    file_count: int


def directory_size(path: Path) -> tuple[int, int]:
    """(total bytes, number of files) under ``path``."""
    files = [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def safetensors_parameter_count(path: Path) -> int:
    """Number of tensor elements in one ``.safetensors`` file, read from its JSON header only.

    The format starts with an 8-byte little-endian header length, then a JSON header
    mapping tensor names to ``{"dtype", "shape", "data_offsets"}``: a 2×3 and a 4 tensor
    count 10.
    """
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return sum(prod(meta["shape"]) for name, meta in header.items() if name != "__metadata__")


def estimator_parameter_count(estimator: object) -> int:
    """Learned numbers of a fitted scikit-learn estimator: its array attributes ending in ``_``.

    LogisticRegression on iris (4 features, 3 classes): coef_ 3×4 + intercept_ 3 + classes_ 3
    + n_iter_ 1 = 19. Pipelines and meta-estimators are counted through their steps.
    """
    import numpy as np

    total = 0
    for name, value in vars(estimator).items():
        if name.endswith("_") and not name.startswith("_") and isinstance(value, np.ndarray):
            if value.dtype != object:
                total += value.size
    for step in getattr(estimator, "steps", []) or []:
        total += estimator_parameter_count(step[1])
    for attr in ("estimator_", "best_estimator_"):
        if hasattr(estimator, attr):
            total += estimator_parameter_count(getattr(estimator, attr))
    for sub in getattr(estimator, "estimators_", []) or []:
        if hasattr(sub, "__dict__"):
            total += estimator_parameter_count(sub)
    return total


def describe(model_dir: Path) -> ModelDescription:
    """Read ``MLmodel`` and the weights in a downloaded model version."""
    mlmodel_path = model_dir / "MLmodel"
    if not mlmodel_path.exists():
        raise FileNotFoundError(f"{model_dir} has no MLmodel file; is it an MLflow model?")
    mlmodel = yaml.safe_load(mlmodel_path.read_text())
    flavors = tuple(mlmodel.get("flavors", {}))
    own = [f for f in flavors if f != "python_function"]
    flavor = own[0] if own else "python_function"
    signature = mlmodel.get("signature")
    if signature:
        signature = {k: json.loads(v) if isinstance(v, str) else v for k, v in signature.items()}
    size_bytes, file_count = directory_size(model_dir)
    return ModelDescription(
        flavor=flavor,
        flavors=flavors,
        is_llm=flavor in LLM_FLAVORS,
        parameter_count=_parameter_count(model_dir, flavor),
        signature=signature,
        size_bytes=size_bytes,
        file_count=file_count,
    )


def _parameter_count(model_dir: Path, flavor: str) -> int | None:
    weights = sorted(model_dir.rglob("*.safetensors"))
    if weights:
        return sum(safetensors_parameter_count(p) for p in weights)
    if flavor == "sklearn":
        import mlflow.sklearn

        return estimator_parameter_count(mlflow.sklearn.load_model(str(model_dir)))
    return None
