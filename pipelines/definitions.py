"""The one composition root of the Dagster code location (``workspace.yaml`` loads it).

Resources are built from ``controlplane.settings.Settings`` (environment variables set by
``modelplane up``), with the same keys in every deployment.
"""

import os

from dagster import Definitions, EnvVar

from assets.cost_model import cost_model
from assets.eval_gate import eval_gate
from assets.quantized_checkpoint import quantized_checkpoint
from assets.served_endpoint import served_endpoint
from assets.serving_image import serving_image
from assets.source_model import source_model
from controlplane.settings import Settings

DATABASE_URL_ENV = "MODELPLANE_DATABASE_URL"
from pipelines.cost_sensor import cost_model_sensor
from pipelines.health import endpoint_health, endpoint_health_sensor, rollback_job
from pipelines.jobs import cost_model_job, deploy_job
from pipelines.resources import (ClusterResource, ControlPlaneResource, ImagesResource, ModelStoreResource,
                                 QuantizerResource, RegistryResource)
from pipelines.sensors import registry_sensor, revision_reaper_sensor
from pipelines.serving_tags_sensor import serving_tags_sensor


def database_url(settings: Settings, environ=os.environ):
    """The control-plane URL as Dagster should hold it: by the name of its environment variable
    where there is one (``modelplane up`` sets it), so the URL, which may carry a password,
    never shows in the Dagster UI's resource configuration."""
    return EnvVar(DATABASE_URL_ENV) if environ.get(DATABASE_URL_ENV) else settings.database_url


# The registry's credentials reach Dagster by name, never as values shown in its UI.
REGISTRY_CREDENTIALS_ENV = {"username": "MODELPLANE_REGISTRY_USERNAME", "password": "MODELPLANE_REGISTRY_PASSWORD"}


def build_resources(settings: Settings, environ=os.environ) -> dict:
    return {
        "control_plane": ControlPlaneResource(database_url=database_url(settings), router_url=settings.router_url),
        "cluster": ClusterResource(backend=settings.cluster, database_url=database_url(settings),
                                   namespace=settings.k8s_namespace,
                                   kubeconfig=str(settings.kubeconfig) if settings.kubeconfig else None,
                                   runtime_image=settings.k8s_runtime_image, models_claim=settings.k8s_models_claim,
                                   home_path=str(settings.home)),
        "registry": RegistryResource(tracking_uri=settings.mlflow_tracking_uri),
        "model_store": ModelStoreResource(root_dir=str(settings.models_dir), evaluations_root=str(settings.eval_results_dir)
                                          if settings.eval_results_dir else None),
        "quantizer": QuantizerResource(python=str(settings.quantize_python)),
        "images": ImagesResource(mode=settings.images, registry_url=settings.registry_url,
                                 work_dir=str(settings.images_dir),
                                 layer_cache_dir=str(settings.layer_cache_dir) if settings.layer_cache_dir else None,
                                 **{key: EnvVar(env) for key, env in REGISTRY_CREDENTIALS_ENV.items() if environ.get(env)}),
    }


defs = Definitions(
    assets=[source_model, quantized_checkpoint, cost_model, serving_image, served_endpoint],
    asset_checks=[eval_gate, endpoint_health],
    jobs=[deploy_job, cost_model_job, rollback_job],
    sensors=[registry_sensor, revision_reaper_sensor, cost_model_sensor, endpoint_health_sensor, serving_tags_sensor],
    resources=build_resources(Settings.from_env()),
)
