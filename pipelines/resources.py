"""Dagster resources: thin, configurable wrappers that hand out the adapters.

The same resource keys are used everywhere (``control_plane``, ``registry``,
``model_store``); ``pipelines/definitions.py`` builds them from ``Settings``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field
from sqlalchemy import Engine

from controlplane.db import make_engine
from controlplane.store import EndpointStore, WebhookInbox
from pipelines.registry import MlflowRegistry, ModelRegistry


@lru_cache(maxsize=8)
def _engine(database_url: str) -> Engine:
    return make_engine(database_url)


class ControlPlaneResource(ConfigurableResource):
    """The control-plane database: endpoint specs and the webhook inbox."""

    database_url: str = Field(description="SQLAlchemy URL of the control-plane database.")

    def endpoints(self) -> EndpointStore:
        return EndpointStore(_engine(self.database_url))

    def inbox(self) -> WebhookInbox:
        return WebhookInbox(_engine(self.database_url))


class RegistryResource(ConfigurableResource):
    """The MLflow model registry."""

    tracking_uri: str = Field(description="MLflow tracking/registry URI (http://… or sqlite:///…).")

    def client(self) -> ModelRegistry:
        return MlflowRegistry(self.tracking_uri)


class ModelStoreResource(ConfigurableResource):
    """Local directory where deploy steps keep downloaded and derived model files."""

    root_dir: str = Field(description="Directory under MODELPLANE_HOME, e.g. .modelplane/models.")

    def version_dir(self, model: str, version: str, step: str) -> Path:
        return Path(self.root_dir) / model / f"v{version}" / step
