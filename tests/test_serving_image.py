"""Serving images end to end: built without Docker, pushed to the embedded registry, and
replicas started from their lazily fetched, mounted seekable form (images/, the supervisor,
``serving_image`` → ``served_endpoint``).

The iris model on the pyfunc runtime keeps it small: its environment layer is ~0.3 GB,
built once per module.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from assets.metadata import table_rows
from images.mount.system import fuse_available
from images.oci.client import HttpRegistry
from images.oci.layout import pull_image
from images.seekable.artifact import find_seekable
from tests.oci_fixtures import embedded_registry  # noqa: F401 - a fixture

pytestmark = pytest.mark.slow
needs_fuse = pytest.mark.skipif(not fuse_available()[0], reason=f"no FUSE here: {fuse_available()[1]}")
IRIS_ROWS = {"dataframe_split": {"columns": ["sepal length (cm)", "sepal width (cm)", "petal length (cm)",
                                             "petal width (cm)"], "data": [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]}}


@pytest.fixture(scope="module")
def images_root(tmp_path_factory):
    return tmp_path_factory.mktemp("images")


@pytest.fixture(scope="module")
def built(embedded_registry, iris, images_root):  # noqa: F811 - the fixture imported above
    from images.serving_image import build_serving_image

    lines = []
    with HttpRegistry(embedded_registry.url) as registry:
        ref, facts = build_serving_image(registry, "modelplane/iris", "v1-pyfunc", iris[1], "pyfunc", {},
                                         images_root / "builds" / "v1", images_root / "cache", log=lines.append)
    return ref, facts, lines


def test_the_image_is_an_ordinary_oci_image_that_skopeo_reads_and_a_full_pull_unpacks(built, embedded_registry,
                                                                                    iris, tmp_path):
    ref, facts, _ = built
    host = embedded_registry.url.split("://")[1]
    inspected = json.loads(subprocess.run(
        ["skopeo", "inspect", "--tls-verify=false", f"docker://{host}/modelplane/iris:v1-pyfunc"],
        capture_output=True, text=True, check=True).stdout)
    assert inspected["Digest"] == ref.manifest_digest
    assert inspected["Layers"] == [layer.layer_digest for layer in ref.layers]
    assert inspected["Labels"]["org.modelplane.runtime"] == "pyfunc"
    with HttpRegistry(embedded_registry.url) as registry:
        stats = pull_image(registry, "modelplane/iris", "v1-pyfunc", tmp_path / "rootfs")
    assert stats.bytes_downloaded == facts["image_bytes"]
    model = tmp_path / "rootfs" / "opt" / "modelplane" / "model"
    assert (model / "MLmodel").read_bytes() == (iris[1] / "MLmodel").read_bytes()
    assert (tmp_path / "rootfs" / "opt" / "modelplane" / "env" / "pyvenv.cfg").is_file()


def test_the_seekable_form_is_an_artifact_that_refers_to_the_image(built, embedded_registry):
    ref, _, _ = built
    with HttpRegistry(embedded_registry.url) as registry:
        assert registry.referrers("modelplane/iris", ref.manifest_digest) is None  # docker-registry 2.8: tag fallback
        found = find_seekable(registry, "modelplane/iris", ref.manifest_digest)
    assert found.manifest_digest == ref.seekable_digest
    assert [(layer.index_digest, layer.data_digest) for layer in found.layers] == \
        [(layer.index_digest, layer.data_digest) for layer in ref.layers]
    env = ref.layer("env")
    assert 0 < env.prefetch_sectors < env.filesystem_bytes // (4 << 20) + 1  # a start-up set, not everything


def test_the_files_the_runtime_opened_while_starting_come_first(built, images_root):
    ref, facts, _ = built
    assert facts["traced_files"]["env"] > 100 and facts["traced_files"]["model"] >= 2  # MLmodel, the weights
    # it imported bytecode: a module without any in the image is a source it opens to compile,
    # at every start (the mount is read-only), and the image's start-up set would be those sources
    [trace] = (images_root / "cache").glob("trace-*.json")
    env_files = json.loads(trace.read_text())["env"]
    sources = [f for f in env_files if f.endswith(".py")]
    assert sum(f.endswith(".pyc") for f in env_files) > 100 and len(sources) < len(env_files) // 20, sources[:10]


def test_a_second_version_reuses_the_environment_layer_and_the_trace_and_only_builds_its_model(
        built, embedded_registry, iris, images_root, tmp_path):
    from images.serving_image import build_serving_image

    first, first_facts, _ = built
    model = shutil.copytree(iris[1], tmp_path / "model-v2")  # the same files, new bytes: a retrained version
    (model / "MLmodel").write_text((model / "MLmodel").read_text() + "\n# v2\n")
    lines = []
    with HttpRegistry(embedded_registry.url) as registry:
        second, facts = build_serving_image(registry, "modelplane/iris", "v2-pyfunc", model, "pyfunc", {},
                                            images_root / "builds" / "v2", images_root / "cache", log=lines.append)
    assert second.layer("env") == first.layer("env")
    assert second.layer("model").layer_digest != first.layer("model").layer_digest
    assert (first_facts["trace"], facts["trace"]) == ("recorded", "cache")  # no replica started under strace
    assert facts["traced_files"] == first_facts["traced_files"]
    assert second.layer("model").prefetch_sectors == first.layer("model").prefetch_sectors > 0
    assert not any("recording the start-up trace" in line for line in lines)


def test_a_model_with_neither_an_example_nor_a_signature_is_traced_until_it_is_loaded(
        built, embedded_registry, iris, images_root, tmp_path):
    """Nothing says what it takes, so no warm-up request: the trace ends once the replica is healthy."""
    from images.serving_image import build_serving_image
    from tests.conftest import copy_without_example_or_signature

    model = copy_without_example_or_signature(iris[1], tmp_path / "model-bare")
    with HttpRegistry(embedded_registry.url) as registry:
        _, facts = build_serving_image(registry, "modelplane/iris", "bare-pyfunc", model, "pyfunc", {},
                                       images_root / "builds" / "bare", images_root / "cache")
    assert facts["trace"] == "recorded" and facts["traced_files"]["model"] > 0  # it loaded the model's files


@pytest.fixture
def supervised(tmp_path, images_root):
    """A supervisor whose replicas start from mounted images; (cluster, engine, mounts root)."""
    from cluster.local.backend import LocalCluster
    from cluster.local.supervisor import Supervisor, SupervisorConfig
    from controlplane import db
    from images.mounts import ImageMounts, MountsConfig

    url = f"sqlite:///{tmp_path / 'controlplane.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    mounts = ImageMounts(tmp_path / "runtime", MountsConfig(max_cache_bytes=1 << 30))
    supervisor = Supervisor(engine, tmp_path / "logs", SupervisorConfig(restart_backoff_initial_s=0.5), mounts)
    stop = threading.Event()
    thread = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield LocalCluster(engine), engine, tmp_path / "runtime"
    finally:
        stop.set()
        thread.join(120)
        engine.dispose()


def wait_ready(cluster, revision_id: str, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = [r for r in cluster.replicas(revision_id) if r.ready]
        if ready:
            return ready
        time.sleep(0.5)
    raise AssertionError(f"{revision_id}: no replica ready after {timeout_s} s")


@needs_fuse
def test_a_replica_runs_the_images_environment_and_model_from_the_mount_and_records_its_cold_start(
        built, iris, supervised):
    from cluster.protocol import RevisionSpec
    from controlplane.revisions import RevisionStore

    ref, _, _ = built
    cluster, engine, runtime_root = supervised
    RevisionStore(engine).create("iris", "iris.v1", str(iris[1]), "pyfunc", {}, 1, image=ref.to_json())
    revision_id = RevisionStore(engine).list("iris")[0].id
    cluster.apply(RevisionSpec(revision_id, "iris", str(iris[1]), "pyfunc", 1, {}, ref.to_json()))
    [replica] = wait_ready(cluster, revision_id)
    answer = httpx.post(f"{replica.url}/invocations", json=IRIS_ROWS, timeout=30)
    assert answer.status_code == 200 and len(answer.json()["predictions"]) == 2

    from sqlalchemy.orm import Session

    from controlplane.schema import ReplicaRow
    with Session(engine) as session:
        pid = session.get(ReplicaRow, replica.replica_id).pid
    mounts_dir = str(runtime_root / "mnt")
    argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    assert argv0.startswith(mounts_dir) and argv0.endswith("/bin/python")  # the image's environment
    mapped = Path(f"/proc/{pid}/maps").read_text()
    assert f"{mounts_dir}/env-" in mapped  # its native libraries come from the mount
    details = RevisionStore(engine).get(revision_id).details
    split = details["cold_start"]
    assert details["started_from"] == ref.reference
    assert split["time_to_ready_s"] >= split["image_s"] + split["weights_s"]
    assert 0 < split["bytes_before_ready"] < split["image_bytes"]

    cluster.delete(revision_id)
    deadline = time.monotonic() + 60
    while any(mounts_dir in line for line in Path("/proc/mounts").read_text().splitlines()):
        assert time.monotonic() < deadline, "the layers are still mounted after the last replica stopped"
        time.sleep(0.2)


IRIS_SPEC = ("name: iris\nmodel: models:/iris@champion\nscaling: {min_replicas: 1, max_replicas: 1}\n"
             "cost_model: {concurrency: [1, 2], requests_per_point: 20, max_point_s: 3}\n")


@needs_fuse
def test_deploying_a_version_builds_its_image_and_serves_it_from_the_mount_with_the_cold_start_in_the_metadata(
        embedded_registry, iris, images_root, supervised, monkeypatch):
    from dagster import DagsterInstance, materialize
    from mlflow import MlflowClient

    from assets.cost_model import cost_model
    from assets.eval_gate import eval_gate
    from assets.quantized_checkpoint import quantized_checkpoint
    from assets.served_endpoint import served_endpoint
    from assets.serving_image import serving_image
    from assets.source_model import source_model
    from cluster.hardware import HardwareProfile
    from controlplane.specs import parse_spec
    from controlplane.store import EndpointStore
    from pipelines.resources import (ClusterResource, ControlPlaneResource, ImagesResource, ModelStoreResource,
                                     QuantizerResource, RegistryResource)

    cluster, engine, runtime_root = supervised
    uri, _ = iris
    MlflowClient(tracking_uri=uri).set_registered_model_alias("iris", "champion", "1")
    monkeypatch.setattr("pipelines.resources.detect_local", lambda: HardwareProfile("cpu", "test CPU", 2.0))
    EndpointStore(engine).put(parse_spec(IRIS_SPEC))
    database_url = str(engine.url)
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("model_versions", ["iris.v1"])
    result = materialize(
        [source_model, quantized_checkpoint, eval_gate, cost_model, serving_image, served_endpoint],
        partition_key="iris.v1", instance=instance, raise_on_error=False,
        resources={"control_plane": ControlPlaneResource(database_url=database_url),
                   "cluster": ClusterResource(database_url=database_url),
                   "registry": RegistryResource(tracking_uri=uri),
                   "model_store": ModelStoreResource(root_dir=str(images_root.parent / "models")),
                   "quantizer": QuantizerResource(python="/nonexistent"),
                   "images": ImagesResource(registry_url=embedded_registry.url, work_dir=str(images_root))})
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    image_meta = result.asset_materializations_for_node("serving_image")[0].metadata
    served = result.asset_materializations_for_node("served_endpoint")[0].metadata
    reference = image_meta["pyfunc_image"].value
    digest = image_meta["pyfunc_digest"].value
    assert image_meta["pyfunc_digest_url"].value == f"{embedded_registry.url}/v2/modelplane/iris/manifests/{digest}"
    assert [row["layer"] for row in table_rows(image_meta["pyfunc_layers_table"].value)] == ["env", "model"]
    assert served["started_from"].value == reference
    split = {key: served[f"cold_start_{key}"].value for key in ("time_to_ready_s", "image_s", "weights_s", "engine_s",
                                                                "bytes_before_ready", "image_bytes")}
    assert split["time_to_ready_s"] > 0 and split["engine_s"] > 0
    assert 0 < split["bytes_before_ready"] < split["image_bytes"]
    [replica] = wait_ready(cluster, served["revision"].value)
    assert httpx.post(f"{replica.url}/invocations", json=IRIS_ROWS, timeout=30).status_code == 200
