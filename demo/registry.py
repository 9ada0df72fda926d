"""Register demo models in MLflow: one experiment, one run per model, one new registered version.

`log_transformers_checkpoint` is shared by every transformers demo model (SmolLM2 and the tiny
Llama); it logs a local checkpoint directory without loading it and never calls the Hugging Face
Hub, because it hands MLflow the model card instead of letting it fetch one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.models.model import ModelInfo

if TYPE_CHECKING:
    import torch
    from huggingface_hub import ModelCard

DEMO_EXPERIMENT = "modelplane-demo"
CHAT_TASK = "llm/v1/chat"


@contextmanager
def using_tracking_uri(uri: str) -> Iterator[MlflowClient]:
    """Point MLflow's fluent API at `uri` for the block and restore the previous URI after it.

    The model registry follows the tracking URI, as in MLflow, unless a registry URI has been
    set separately (MLFLOW_REGISTRY_URI or `mlflow.set_registry_uri`).
    """
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        yield MlflowClient(tracking_uri=uri)
    finally:
        mlflow.set_tracking_uri(previous)


def experiment_id(client: MlflowClient, name: str = DEMO_EXPERIMENT) -> str:
    """Return the id of experiment `name`, creating it when it does not exist yet."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    return client.create_experiment(name)


def registered_version(
    client: MlflowClient, info: ModelInfo, registered_model_name: str, description: str
) -> ModelVersion:
    """Describe the version that `log_model` just registered and return it."""
    version = info.registered_model_version
    if version is None:
        raise RuntimeError(f"log_model did not register a version of {registered_model_name!r}")
    return client.update_model_version(registered_model_name, str(version), description)


def _model_card(description: str, license_id: str) -> ModelCard:
    """A Hugging Face model card built locally, so MLflow has no reason to fetch one."""
    from huggingface_hub import ModelCard

    return ModelCard(f"---\nlicense: {license_id}\nlibrary_name: transformers\n---\n\n{description}\n")


def _checkpoint_dtype(checkpoint_dir: Path) -> torch.dtype | None:
    """The torch dtype a checkpoint's config.json declares, or None when it declares none."""
    import torch

    config = json.loads((checkpoint_dir / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) else None


def transformers_requirements() -> list[str]:
    """Pinned pip requirements for serving a transformers checkpoint with this environment.

    Given explicitly because MLflow's default list for torch models includes torchvision and
    fails when it is not installed. Local version labels ("+cpu") are dropped so pip can
    resolve the pins from PyPI.
    """
    packages = ("mlflow", "transformers", "tokenizers", "safetensors", "accelerate", "torch")
    return [f"{name}=={metadata.version(name).split('+')[0]}" for name in packages]


def log_transformers_checkpoint(
    tracking_uri: str,
    checkpoint_dir: Path,
    registered_model_name: str,
    description: str,
    *,
    license_id: str = "apache-2.0",
    task: str = CHAT_TASK,
) -> ModelVersion:
    """Log a local transformers checkpoint as a chat model and register it as a new version.

    The directory is passed to MLflow as a path, so MLflow copies it instead of loading the
    model; the pyfunc signature is the OpenAI-style chat schema of `task` ("llm/v1/chat").
    """
    checkpoint_dir = Path(checkpoint_dir).resolve()
    with using_tracking_uri(tracking_uri) as client:
        with mlflow.start_run(
            experiment_id=experiment_id(client),
            run_name=registered_model_name,
            description=description,
        ):
            info = mlflow.transformers.log_model(
                transformers_model=str(checkpoint_dir),
                name="model",
                task=task,
                torch_dtype=_checkpoint_dtype(checkpoint_dir),
                model_card=_model_card(description, license_id),
                pip_requirements=transformers_requirements(),
                registered_model_name=registered_model_name,
            )
        return registered_version(client, info, registered_model_name, description)
