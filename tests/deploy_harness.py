"""The deploy job of tests/test_deploy_gate.py on real parts, for the modules that drive it: one
MLflow store, one control-plane database, a running supervisor; deploy runs on demand."""

import os
import threading
from pathlib import Path

from dagster import DagsterInstance, materialize

from assets.cost_model import cost_model
from assets.eval_gate import eval_gate
from assets.quantized_checkpoint import quantized_checkpoint
from assets.served_endpoint import served_endpoint
from assets.serving_image import serving_image
from assets.source_model import source_model
from controlplane import db
from controlplane.revisions import RevisionStore
from controlplane.specs import parse_spec
from controlplane.store import EndpointStore
from pipelines.resources import (ClusterResource, ControlPlaneResource, ImagesResource, ModelStoreResource,
                                 QuantizerResource, RegistryResource)

REPO = Path(__file__).resolve().parent.parent
QUANTIZE_PYTHON = REPO / ".venv-quantize" / "bin" / "python"
SPEC = ("name: tiny\nmodel: models:/tiny-llm@champion\nscaling: {min_replicas: 1, max_replicas: 1}\n"
        "slo: {p99_latency_ms: 5000}\n"
        "cost_model: {input_tokens: [16, 64], output_tokens: [4, 64], concurrency: [1, 4], max_point_s: 5}\n")


class Deployment:
    """One MLflow store, one control-plane database, a running supervisor; deploy runs on demand."""

    mlflow_ui_url: str | None = None  # the registry resource's ui_url: links in the metadata when set

    def __init__(self, root: Path) -> None:
        from mlflow import MlflowClient

        from cluster.local.supervisor import Supervisor, SupervisorConfig

        self.root = root
        self.uri = f"sqlite:///{root / 'mlflow.db'}"
        self.mlflow = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self.mlflow.create_experiment("modelplane-demo", artifact_location=(root / "artifacts").as_uri())
        self.database_url = f"sqlite:///{root / 'controlplane.db'}"
        db.upgrade(self.database_url)
        self.engine = db.make_engine(self.database_url)
        self.specs = EndpointStore(self.engine)
        self.specs.put(parse_spec(SPEC))
        self.instance = DagsterInstance.ephemeral()
        self.supervisor = Supervisor(self.engine, root / "logs", SupervisorConfig(restart_backoff_initial_s=0.5))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.supervisor.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def register(self, checkpoint: Path, model: str = "tiny-llm") -> str:
        from demo.tiny_llama import log_tiny_llama

        version = str(log_tiny_llama(self.uri, checkpoint, registered_model_name=model).version)
        self.mlflow.set_registered_model_alias(model, "champion", version)
        return version

    def deploy(self, version: str, *, worker: Path | None = None, assets=None, model: str = "tiny-llm",
               memory_gib: float | None = None):
        key = f"{model}.v{version}"
        self.instance.add_dynamic_partitions("model_versions", [key])
        quantizer = QuantizerResource(python=str(QUANTIZE_PYTHON), **({"worker": str(worker)} if worker else {}))
        return materialize(
            assets or [source_model, quantized_checkpoint, eval_gate, cost_model, serving_image, served_endpoint],
            partition_key=key,
            instance=self.instance, raise_on_error=False,
            resources={"control_plane": ControlPlaneResource(database_url=self.database_url),
                       "cluster": ClusterResource(database_url=self.database_url, memory_gib=memory_gib),
                       "registry": RegistryResource(tracking_uri=self.uri, ui_url=self.mlflow_ui_url),
                       # `make test` names one results directory for every platform of the run
                       "model_store": ModelStoreResource(root_dir=str(self.root / "models"),
                                                         evaluations_root=os.environ.get("MODELPLANE_EVAL_RESULTS_DIR")),
                       "quantizer": quantizer,
                       # started in place here; tests/test_serving_image.py starts replicas from images
                       "images": ImagesResource(mode="off", work_dir=str(self.root / "images"))})

    def champion(self) -> str:
        """The version the spec's alias points at (deploys of other versions serve no endpoint)."""
        return str(self.mlflow.get_model_version_by_alias("tiny-llm", "champion").version)

    def cluster(self):
        from cluster.local.backend import LocalCluster

        return LocalCluster(self.engine)

    def serving_revision(self, endpoint: str = "tiny"):
        revisions = RevisionStore(self.engine)
        revision_id = revisions.traffic().get(endpoint)
        return revisions.get(revision_id) if revision_id else None

    def close(self) -> None:
        self.stop.set()
        self.thread.join(120)
        self.engine.dispose()


def check_of(result):
    [evaluation] = result.get_asset_check_evaluations()
    return evaluation
