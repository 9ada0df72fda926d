"""The model registry as the deploy pipeline needs it: five calls, one Protocol.

``MlflowRegistry`` talks to a real MLflow tracking server (or a SQL store URI);
``InMemoryRegistry`` is the fake for unit tests of logic. ``tests/test_registry.py``
runs the same contract against both.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Protocol


@dataclass(frozen=True)
class RegisteredVersion:
    model: str
    version: str
    source: str
    run_id: str | None = None
    description: str | None = None
    tags: dict[str, str] = field(default_factory=dict)


class RegistryError(Exception):
    """The registry could not answer (unreachable, or refused the request)."""


class ModelRegistry(Protocol):
    def alias_version(self, model: str, alias: str) -> str | None:
        """The version the alias points at, or None when the model or alias does not exist."""

    def model_version(self, model: str, version: str) -> RegisteredVersion:
        """Details of one version; raises ``KeyError`` when it does not exist."""

    def download(self, model: str, version: str, dst: Path) -> Path:
        """Copy the version's artifacts into ``dst`` (replaced atomically) and return it."""

    def log_derived(self, model: str, version: str, kind: str, local_dir: Path, tags: dict[str, str],
                    metrics: dict[str, float]) -> str:
        """Log files derived from a version (e.g. its quantized checkpoint) as a run, linked by tags.

        The run carries ``modelplane.source_model``, ``modelplane.source_version`` and
        ``modelplane.kind`` tags; the version gets ``modelplane.<kind>.run_id``. Returns the run id.
        """

    def set_version_tags(self, model: str, version: str, tags: Mapping[str, str | None]) -> None:
        """Set the version's tags; a ``None`` value deletes that tag (absent already is fine).
        Raises ``KeyError`` when the version does not exist (``pipelines.version_tags`` names them)."""


DERIVED_EXPERIMENT = "modelplane-derived"


def link_tags(model: str, version: str, kind: str) -> dict[str, str]:
    """Tags that tie a derived run to the version it came from."""
    return {"modelplane.source_model": model, "modelplane.source_version": version, "modelplane.kind": kind}


def partition_key(model: str, version: str) -> str:
    """``gec`` version ``3`` deploys as partition ``gec.v3``."""
    return f"{model}.v{version}"


def parse_partition_key(key: str) -> tuple[str, str]:
    """Inverse of :func:`partition_key`: ``"gec.v3"`` → ``("gec", "3")``."""
    model, sep, version = key.rpartition(".v")
    if not sep or not model or not version.isdigit():
        raise ValueError(f"partition key {key!r} is not of the form <model>.v<version>")
    return model, version


def _replace_dir(staging: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(dst)


class MlflowRegistry:
    """The MLflow model registry (``MlflowClient``) behind :class:`ModelRegistry`."""

    def __init__(self, tracking_uri: str) -> None:
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        self._client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    def alias_version(self, model: str, alias: str) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            return str(self._client.get_model_version_by_alias(model, alias).version)
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
                return None
            raise RegistryError(f"MLflow at {self.tracking_uri}: {exc.message}") from exc
        except OSError as exc:  # requests' ConnectionError is an OSError
            raise RegistryError(f"MLflow at {self.tracking_uri} is unreachable: {exc}") from exc

    def model_version(self, model: str, version: str) -> RegisteredVersion:
        from mlflow.exceptions import MlflowException

        try:
            mv = self._client.get_model_version(model, version)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise KeyError(f"{model} version {version} is not registered") from exc
            raise RegistryError(f"MLflow at {self.tracking_uri}: {exc.message}") from exc
        return RegisteredVersion(
            model=mv.name,
            version=str(mv.version),
            source=mv.source,
            run_id=mv.run_id or None,
            description=mv.description or None,
            tags=dict(mv.tags or {}),
        )

    def download(self, model: str, version: str, dst: Path) -> Path:
        import mlflow.artifacts

        dst.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
        try:
            # Resolve through our client: a "models:/" URI would use the process-wide registry URI.
            source_uri = self._client.get_model_version_download_uri(model, version)
            downloaded = mlflow.artifacts.download_artifacts(
                artifact_uri=source_uri, dst_path=str(staging), tracking_uri=self.tracking_uri
            )
            # A directory source lands as <staging>/<its basename>; take whatever came back.
            _replace_dir(Path(downloaded), dst)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return dst

    def log_derived(self, model: str, version: str, kind: str, local_dir: Path, tags: dict[str, str],
                    metrics: dict[str, float]) -> str:
        source = self.model_version(model, version)
        experiment_id = self._experiment_for(source)
        run = self._client.create_run(experiment_id, run_name=f"{model}-v{version}-{kind}",
                                      tags={**link_tags(model, version, kind), **tags})
        try:
            for name, value in metrics.items():
                self._client.log_metric(run.info.run_id, name, value)
            self._client.log_artifacts(run.info.run_id, str(local_dir), artifact_path=kind)
        except Exception:
            self._client.set_terminated(run.info.run_id, "FAILED")
            raise
        self._client.set_terminated(run.info.run_id, "FINISHED")
        self._client.set_model_version_tag(model, version, f"modelplane.{kind}.run_id", run.info.run_id)
        return run.info.run_id

    def set_version_tags(self, model: str, version: str, tags: Mapping[str, str | None]) -> None:
        from mlflow.exceptions import MlflowException

        try:
            for key, value in tags.items():
                if value is None:
                    self._client.delete_model_version_tag(model, version, key)
                else:
                    self._client.set_model_version_tag(model, version, key, value)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise KeyError(f"{model} version {version} is not registered") from exc
            raise RegistryError(f"MLflow at {self.tracking_uri}: {exc.message}") from exc
        except OSError as exc:
            raise RegistryError(f"MLflow at {self.tracking_uri} is unreachable: {exc}") from exc

    def _experiment_for(self, source: RegisteredVersion) -> str:
        """The experiment of the run that logged the version, else ``modelplane-derived``."""
        if source.run_id:
            return self._client.get_run(source.run_id).info.experiment_id
        existing = self._client.get_experiment_by_name(DERIVED_EXPERIMENT)
        return existing.experiment_id if existing else self._client.create_experiment(DERIVED_EXPERIMENT)


class InMemoryRegistry:
    """A registry held in dicts, for tests. Files of a version are given as {relative path: bytes}."""

    def __init__(self) -> None:
        self._versions: dict[tuple[str, str], RegisteredVersion] = {}
        self._files: dict[tuple[str, str], dict[str, bytes]] = {}
        self._aliases: dict[tuple[str, str], str] = {}
        self.derived: dict[str, dict] = {}  # run id → what log_derived recorded

    def register(self, model: str, files: dict[str, bytes] | None = None, **details: object) -> str:
        version = str(1 + sum(1 for m, _ in self._versions if m == model))
        self._versions[(model, version)] = RegisteredVersion(
            model=model, version=version, source=f"memory://{model}/{version}", **details
        )
        self._files[(model, version)] = dict(files or {})
        return version

    def set_alias(self, model: str, alias: str, version: str) -> None:
        if (model, version) not in self._versions:
            raise KeyError(f"{model} version {version} is not registered")
        self._aliases[(model, alias)] = version

    def alias_version(self, model: str, alias: str) -> str | None:
        return self._aliases.get((model, alias))

    def model_version(self, model: str, version: str) -> RegisteredVersion:
        try:
            return self._versions[(model, version)]
        except KeyError:
            raise KeyError(f"{model} version {version} is not registered") from None

    def download(self, model: str, version: str, dst: Path) -> Path:
        self.model_version(model, version)
        dst.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
        for relative, content in self._files[(model, version)].items():
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            (staging / relative).write_bytes(content)
        _replace_dir(staging, dst)
        return dst

    def log_derived(self, model: str, version: str, kind: str, local_dir: Path, tags: dict[str, str],
                    metrics: dict[str, float]) -> str:
        registered = self.model_version(model, version)
        run_id = f"memory-run-{len(self.derived) + 1}"
        files = sorted(str(p.relative_to(local_dir)) for p in Path(local_dir).rglob("*") if p.is_file())
        self.derived[run_id] = {"tags": {**link_tags(model, version, kind), **tags}, "metrics": dict(metrics),
                                "files": files}
        registered.tags[f"modelplane.{kind}.run_id"] = run_id
        return run_id

    def set_version_tags(self, model: str, version: str, tags: Mapping[str, str | None]) -> None:
        registered = self.model_version(model, version)
        for key, value in tags.items():
            if value is None:
                registered.tags.pop(key, None)
            else:
                registered.tags[key] = value
