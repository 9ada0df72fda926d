"""Describing a downloaded MLflow model directory: flavor, signature, parameters, size."""

from __future__ import annotations

import ast
import json
import struct
import zipfile
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
    + n_iter_ 1 = 19. Pipelines and meta-estimators are counted through their steps; a step
    that is ``"passthrough"`` or ``None`` counts 0, as does boosting's array of trees.
    """
    import numpy as np

    if not hasattr(estimator, "__dict__"):
        return 0
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
    subs = getattr(estimator, "estimators_", None)
    if subs is not None and not isinstance(subs, np.ndarray):  # an array of trees (boosting): not counted
        for sub in subs:
            if hasattr(sub, "__dict__"):
                total += estimator_parameter_count(sub)
    return total


class UnreadableSchema(ValueError):
    """A skops file whose schema this reader does not follow; the model is loaded instead."""


def skops_parameter_count(path: Path) -> int:
    """:func:`estimator_parameter_count` of the estimator in a ``.skops`` file, read from the
    file's ``schema.json`` and its arrays' ``.npy`` headers, without loading the estimator.

    Loading runs skops' list of trusted types, which imports every module of scikit-learn
    (and, through its array-API shims, torch where it is installed): 10 CPU-seconds for a
    19-number model on a slow 2-core machine. Raises :class:`UnreadableSchema` for a structure
    this reader does not follow (the caller then loads the model).
    """
    with zipfile.ZipFile(path) as archive:
        schema = json.loads(archive.read("schema.json"))

        def array_size(node: dict) -> int:
            if node.get("type") != "numpy" or "file" not in node:
                return 0  # an object array, stored as JSON: not counted
            with archive.open(node["file"]) as npy:
                header = _npy_header(npy.read(4096))
            return 0 if header["descr"] in ("|O", "O") else prod(header["shape"])

        return _schema_count(schema, array_size)


def _npy_header(head: bytes) -> dict:
    """The header dict of a ``.npy`` file (format versions 1-3) from its first bytes.

    >>> import io, numpy as np; npy = io.BytesIO(); np.save(npy, np.zeros((3, 4)))
    >>> _npy_header(npy.getvalue())["shape"]
    (3, 4)
    """
    if head[:6] != b"\x93NUMPY":
        raise UnreadableSchema("an array entry is not a .npy file")
    if head[6] == 1:
        (length,), start = struct.unpack("<H", head[8:10]), 10
    else:
        (length,), start = struct.unpack("<I", head[8:12]), 12
    if start + length > len(head):
        raise UnreadableSchema("a .npy header longer than expected")
    return ast.literal_eval(head[start:start + length].decode("latin-1"))


def _schema_count(node: dict, array_size) -> int:
    """The count for one ObjectNode of a skops schema (mirrors :func:`estimator_parameter_count`)."""
    if node.get("__loader__") == "JsonNode":
        return 0  # a "passthrough" or None step
    if node.get("__loader__") != "ObjectNode":
        raise UnreadableSchema(f"a {node.get('__loader__')} where an estimator was expected")
    content = node.get("content")
    if not isinstance(content, dict) or content.get("__loader__") != "DictNode":
        raise UnreadableSchema(f"{node.get('__class__')}'s attributes are not a dict")
    attributes: dict = content["content"]
    total = 0
    for name, value in attributes.items():
        if name.endswith("_") and not name.startswith("_") and value.get("__loader__") == "NdArrayNode" \
                and value.get("__module__") == "numpy" and value.get("__class__") == "ndarray":
            total += array_size(value)
    for step in _items(attributes.get("steps")):
        parts = _items(step)
        if len(parts) != 2:
            raise UnreadableSchema("a pipeline step that is not a (name, estimator) pair")
        total += _schema_count(parts[1], array_size)
    for attr in ("estimator_", "best_estimator_"):
        if attr in attributes:
            total += _schema_count(attributes[attr], array_size)
    estimators = attributes.get("estimators_")
    if estimators is not None and estimators.get("__loader__") != "NdArrayNode":  # an array of trees: no __dict__
        for sub in _items(estimators):
            if sub.get("__loader__") != "JsonNode":
                total += _schema_count(sub, array_size)
    return total


def _items(node: dict | None) -> list[dict]:
    """The elements of a ListNode or TupleNode (none for an absent or null attribute)."""
    if node is None or node.get("__loader__") == "JsonNode":
        return []
    if node.get("__loader__") not in ("ListNode", "TupleNode") or not isinstance(node.get("content"), list):
        raise UnreadableSchema(f"a {node.get('__loader__')} where a list was expected")
    return node["content"]


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
        parameter_count=_parameter_count(model_dir, flavor, mlmodel),
        signature=signature,
        size_bytes=size_bytes,
        file_count=file_count,
    )


def _parameter_count(model_dir: Path, flavor: str, mlmodel: dict) -> int | None:
    weights = sorted(model_dir.rglob("*.safetensors"))
    if weights:
        return sum(safetensors_parameter_count(p) for p in weights)
    if flavor == "sklearn":
        sklearn = mlmodel["flavors"]["sklearn"]
        if sklearn.get("serialization_format") == "skops" and sklearn.get("pickled_model"):
            try:
                return skops_parameter_count(model_dir / sklearn["pickled_model"])
            except (KeyError, OSError, zipfile.BadZipFile, ValueError, SyntaxError, AttributeError, TypeError):
                pass  # UnreadableSchema (a ValueError) or a damaged file: read it the slow way
        import mlflow.sklearn

        return estimator_parameter_count(mlflow.sklearn.load_model(str(model_dir)))
    return None
