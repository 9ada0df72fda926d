"""``PyfuncRuntime``: the :class:`~serving.runtime.base.ReplicaRuntime` for classic MLflow models.

Cheap to import (no MLflow, pandas or numpy): the cluster backend's supervisor uses it to build
a replica's command line, its probe request and its progress from ``/metrics``. The MLmodel
file is read as YAML directly.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from serving.runtime.base import ProbeRequest, Progress, ReplicaLaunch, RuntimeConfig
from serving.runtime.cpu import available_cpus
from serving.runtime.pyfunc.config import thread_env
from serving.runtime.pyfunc.metrics import COMPLETED, IN_FLIGHT, QUEUE_DEPTH
from serving.runtime.scrape import samples_named

REPO_ROOT = Path(__file__).resolve().parents[3]  # where `serving` is importable from
SERVING_INPUT_EXAMPLE = "serving_input_example.json"
FRAME_KEYS = ("dataframe_split", "dataframe_records")

# One placeholder value per MLflow column type: the probe only has to pass the signature.
PLACEHOLDERS: dict[str, Any] = {"double": 0.0, "float": 0.0, "long": 0, "integer": 0, "boolean": False,
                                "string": "", "binary": "", "datetime": "1970-01-01T00:00:00", "array": [],
                                "object": {}, "map": {}, "any": None}


class PyfuncRuntime:
    """modelplane's pyfunc scoring server (``python -m serving.runtime.pyfunc``)."""

    name = "pyfunc"

    def command(self, model_dir: Path, host: str, port: int, config: RuntimeConfig) -> ReplicaLaunch:
        cpus = config.cpu_cores if config.cpu_cores is not None else available_cpus()
        argv = [sys.executable, "-m", "serving.runtime.pyfunc", "--model-dir", str(model_dir), "--host", host,
                "--port", str(port), "--workers", str(config.workers), "--max-batch-size", str(config.max_batch_size),
                "--max-batch-wait-ms", str(config.max_batch_wait_ms)]
        python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        return ReplicaLaunch(argv=argv, env={**thread_env(cpus, config.workers), "PYTHONPATH": python_path})

    def probe_request(self, model_dir: Path, config: RuntimeConfig) -> ProbeRequest | None:
        """One row from the logged serving input example, else one placeholder row from the
        signature, else None (a model logged with neither: what it takes is unknown)."""
        example = Path(model_dir) / SERVING_INPUT_EXAMPLE
        if example.is_file():
            return ProbeRequest("/invocations", first_row_of(json.loads(example.read_text())))
        specs = signature_inputs(Path(model_dir))
        return ProbeRequest("/invocations", request_from_signature(specs)) if specs else None

    def progress(self, metrics_text: str) -> Progress:
        """Sums the samples by name, so it reads both a single process's and a merged multiprocess scrape."""
        wanted = {f"{COMPLETED}_total": 0.0, IN_FLIGHT: 0.0, QUEUE_DEPTH: 0.0}
        for sample in samples_named(metrics_text, wanted):
            wanted[sample.name] += sample.value
        return Progress(completed_total=wanted[f"{COMPLETED}_total"], in_flight=wanted[IN_FLIGHT],
                        queued=wanted[QUEUE_DEPTH])


def first_row_of(payload: dict) -> dict:
    """The request cut to its first row, for the dataframe formats (tensor inputs stay whole).

    >>> first_row_of({"dataframe_split": {"columns": ["a"], "data": [[1], [2]]}})
    {'dataframe_split': {'columns': ['a'], 'data': [[1]]}}
    """
    trimmed = dict(payload)
    if isinstance(payload.get("dataframe_split"), dict):
        split = dict(payload["dataframe_split"])
        for key in ("data", "index"):
            if isinstance(split.get(key), list):
                split[key] = split[key][:1]
        trimmed["dataframe_split"] = split
    elif isinstance(payload.get("dataframe_records"), list):
        trimmed["dataframe_records"] = payload["dataframe_records"][:1]
    return trimmed


def signature_inputs(model_dir: Path) -> list[dict]:
    """The ``signature.inputs`` column specs of an MLmodel file; [] when it has no signature."""
    mlmodel = yaml.safe_load((model_dir / "MLmodel").read_text())
    inputs = (mlmodel.get("signature") or {}).get("inputs")
    if not inputs:
        return []
    return json.loads(inputs) if isinstance(inputs, str) else inputs


def request_from_signature(specs: list[dict]) -> dict:
    """A one-row request that satisfies the signature.

    >>> request_from_signature([{"type": "double", "name": "x"}, {"type": "string", "name": "s"}])
    {'dataframe_split': {'columns': ['x', 's'], 'data': [[0.0, '']]}}
    >>> request_from_signature([{"type": "tensor", "tensor-spec": {"dtype": "float32", "shape": [-1, 2]}}])
    {'inputs': [[0, 0]]}
    """
    if all("name" in spec and spec.get("type") != "tensor" for spec in specs):
        columns = [spec["name"] for spec in specs]
        return {"dataframe_split": {"columns": columns, "data": [[PLACEHOLDERS.get(s["type"]) for s in specs]]}}
    tensors = {spec.get("name"): _zeros([1 if d == -1 else d for d in spec["tensor-spec"]["shape"]])
               for spec in specs}
    if len(tensors) == 1 and None in tensors:
        return {"inputs": tensors[None]}
    return {"inputs": tensors}


def _zeros(shape: list[int]) -> Any:
    return 0 if not shape else [_zeros(shape[1:]) for _ in range(shape[0])]
