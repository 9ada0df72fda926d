"""deploy/: the Kubernetes manifests that install modelplane itself (docs/kubernetes.md).

Every object is valid for the three most recent Kubernetes minor versions kubernetes-validate
ships (strict schemas: an unknown field is an error), as written and as the example overlay
renders it; so is the Job dagster-k8s builds for a run worker from deploy/base/dagster.yaml.
The rest reads as the security posture: who may call which API, where tokens are mounted,
how credentials travel, what each container may do, and that nothing long-running lacks a probe.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.kube_schemas import K8S_VERSIONS, validate

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
BASE = DEPLOY / "base"
OVERLAY = DEPLOY / "overlays" / "example"
DAGSTER_YAML = BASE / "dagster.yaml"
DOCS = REPO / "docs" / "kubernetes.md"

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob"}
#: The Services and the ports components are reached on (the ports `modelplane up` uses).
SERVICE_PORTS = {"modelplane-router": 8080, "modelplane-admin-api": 8100,
                 "modelplane-dagster-webserver": 3000, "modelplane-mlflow": 5000}


# -- loading ---------------------------------------------------------------------------------
def kustomizations() -> list[Path]:
    return sorted(DEPLOY.rglob("kustomization.yaml"))


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def generator_files() -> set[Path]:
    """Files that configMapGenerator/secretGenerator entries read (not Kubernetes objects)."""
    files = set()
    for kustomization in kustomizations():
        for generator in [*_load(kustomization).get("configMapGenerator", []), *_load(kustomization).get("secretGenerator", [])]:
            for entry in generator.get("files", []):
                files.add((kustomization.parent / entry.split("=", 1)[-1]).resolve())
    return files


def object_files() -> list[Path]:
    """Every YAML file under deploy/ that holds Kubernetes objects."""
    skip = {p.resolve() for p in kustomizations()} | generator_files()
    return sorted(p for p in [*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")] if p.resolve() not in skip)


@dataclass(frozen=True)
class Obj:
    path: Path
    body: dict

    @property
    def kind(self) -> str:
        return self.body["kind"]

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    def __str__(self) -> str:
        return f"{self.path.relative_to(DEPLOY)}:{self.kind}/{self.name}"


def load_objects() -> list[Obj]:
    return [Obj(path, body) for path in object_files() for body in yaml.safe_load_all(path.read_text()) if body]


OBJECTS = load_objects()


def of_kind(kind: str, objects: list[Obj] = OBJECTS) -> list[Obj]:
    return [o for o in objects if o.kind == kind]


def named(kind: str, name: str, objects: list[Obj] = OBJECTS) -> Obj:
    matches = [o for o in objects if o.kind == kind and o.name == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def pod_spec(obj: Obj) -> dict:
    spec = obj.body["spec"]
    if obj.kind == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return spec["template"]["spec"]


def component(obj: Obj) -> str:
    return obj.body["metadata"]["labels"]["app.kubernetes.io/component"]


# -- the run worker's Job, as dagster-k8s builds it from dagster.yaml -------------------------
RUN_LAUNCHER_ENV = {"MODELPLANE_K8S_NAMESPACE": "modelplane", "MODELPLANE_IMAGE": "registry.example.com/modelplane:1"}


def dagster_instance() -> dict:
    return _load(DAGSTER_YAML)


def run_worker_job(monkeypatch) -> Obj:
    """The Job K8sRunLauncher would create for a run of `deploy`, built by dagster-k8s's own
    code (launcher config → container context → construct_dagster_k8s_job), as the API sees it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dagster-k8s 0.29.27 next to dagster 1.13.28: a version warning
        import kubernetes
        from dagster._config import process_config
        from dagster._core.code_pointer import ModuleCodePointer
        from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
        from dagster._core.storage.dagster_run import DagsterRun
        from dagster_k8s.container_context import K8sContainerContext
        from dagster_k8s.job import construct_dagster_k8s_job
        from dagster_k8s.launcher import K8sRunLauncher

    for key, value in RUN_LAUNCHER_ENV.items():
        monkeypatch.setenv(key, value)
    processed = process_config(K8sRunLauncher.config_type(), dagster_instance()["run_launcher"]["config"])
    assert processed.success, processed.errors
    config = processed.value
    # K8sRunLauncher.__init__ loads the in-cluster kube config; the parts of it that shape a
    # Job are its config values, which is all create_for_run reads.
    launcher = types.SimpleNamespace(**{key: config.get(key) for key in (
        "image_pull_policy", "image_pull_secrets", "service_account_name", "env_config_maps", "env_secrets",
        "env_vars", "volume_mounts", "volumes", "labels", "resources", "scheduler_name", "security_context",
        "run_k8s_config", "only_allow_user_defined_k8s_config_fields", "only_allow_user_defined_env_vars",
        "job_image", "dagster_home", "instance_config_map", "postgres_password_secret", "job_namespace")})
    origin = JobPythonOrigin("deploy", RepositoryPythonOrigin(
        executable_path="/app/.venv/bin/python",
        code_pointer=ModuleCodePointer("pipelines.definitions", "defs", working_directory="/app")))
    run = DagsterRun(job_name="deploy", run_id="0f1e2d3c4b5a69788796a5b4c3d2e1f0", job_code_origin=origin)
    context = K8sContainerContext.create_for_run(run, launcher, include_run_tags=True)
    job = construct_dagster_k8s_job(
        job_config=context.get_k8s_job_config(None, launcher), args=["dagster", "api", "execute_run", "{}"],
        job_name="dagster-run-0f1e2d3c", pod_name="dagster-run-0f1e2d3c", component="run_worker",
        user_defined_k8s_config=context.run_k8s_config, labels={"dagster/job": "deploy"},
        env_vars=[{"name": "DAGSTER_RUN_JOB_NAME", "value": "deploy"}])
    body = kubernetes.client.ApiClient().sanitize_for_serialization(job)
    body["metadata"].setdefault("labels", {})
    return Obj(DAGSTER_YAML, body)


@pytest.fixture
def run_worker(monkeypatch) -> Obj:
    return run_worker_job(monkeypatch)


def workloads(run_worker: Obj | None = None) -> list[Obj]:
    found = [o for o in OBJECTS if o.kind in WORKLOAD_KINDS]
    return found + ([run_worker] if run_worker is not None else [])


def containers(obj: Obj, init: bool = True) -> list[dict]:
    spec = pod_spec(obj)
    return [*spec.get("containers", []), *(spec.get("initContainers", []) if init else [])]


# -- schemas ---------------------------------------------------------------------------------
def test_there_is_something_to_check():
    kinds = {o.kind for o in OBJECTS}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ServiceAccount", "Role", "RoleBinding",
            "ConfigMap", "PersistentVolumeClaim"} <= kinds, kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("obj", OBJECTS, ids=str)
def test_every_object_is_valid_for_kubernetes(obj: Obj, version: str):
    assert validate(obj.body, version) == []


def test_the_three_newest_kubernetes_versions_are_checked():
    from kubernetes_validate import utils

    newest = sorted(set(utils.all_versions()), key=lambda v: tuple(int(p) for p in v.split(".")))[-3:]
    assert list(K8S_VERSIONS) == newest
    assert len({v.rsplit(".", 1)[0] for v in K8S_VERSIONS}) == 3  # three minor versions


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_run_worker_job_dagster_k8s_builds_is_valid_for_kubernetes(run_worker: Obj, version: str):
    assert validate(run_worker.body, version) == []


# -- Kustomize -------------------------------------------------------------------------------
@pytest.mark.parametrize("kustomization", kustomizations(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_kustomization_names_what_exists(kustomization: Path):
    data = _load(kustomization)
    assert data.get("resources"), "a kustomization with nothing in it"
    for entry in data["resources"]:
        target = kustomization.parent / entry
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{entry} does not exist"
    for generator in data.get("configMapGenerator", []):
        for entry in generator.get("files", []):
            assert (kustomization.parent / entry.split("=", 1)[-1]).is_file(), f"{entry} does not exist"


def test_every_object_file_is_in_a_kustomization():
    listed = set()
    for kustomization in kustomizations():
        for entry in _load(kustomization).get("resources", []):
            listed.add((kustomization.parent / entry).resolve())
    unlisted = [str(p.relative_to(DEPLOY)) for p in object_files() if p.resolve() not in listed]
    assert unlisted == []


def test_the_dagster_instance_is_the_configmap_dagster_yaml_names():
    generators = {g["name"]: g for g in _load(BASE / "kustomization.yaml").get("configMapGenerator", [])}
    launcher = dagster_instance()["run_launcher"]["config"]
    generator = generators[launcher["instance_config_map"]]
    assert generator["files"] == ["dagster.yaml"]
    # dagster.yaml names it itself, where Kustomize cannot add a hash suffix to the name
    assert generator["options"]["disableNameSuffixHash"] is True


def kubectl_kustomize(directory: Path) -> list[dict]:
    out = subprocess.run([shutil.which("kubectl"), "kustomize", str(directory)], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return [body for body in yaml.safe_load_all(out) if body]


def _json_pointer_apply(document: dict, op: dict) -> None:
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
    node = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key = int(last) if isinstance(node, list) and last != "-" else last
    if op["op"] in ("replace", "add"):
        if op["op"] == "replace":
            node[key]  # noqa: B018 - replace needs an existing member (KeyError otherwise)
        if isinstance(node, list) and op["op"] == "add":
            node.insert(len(node) if key == "-" else key, op["value"])
        else:
            node[key] = op["value"]
    elif op["op"] == "remove":
        del node[key]
    else:
        raise NotImplementedError(op["op"])


def render_kustomization(directory: Path) -> list[dict]:
    """The part of Kustomize these kustomizations use (resources, configMapGenerator from
    files, namespace, images, JSON 6902 patches), for where kubectl is not installed; the
    test below checks it renders what `kubectl kustomize` renders."""
    kustomization = _load(directory / "kustomization.yaml")
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        target = directory / entry
        objects += render_kustomization(target) if target.is_dir() else \
            [body for body in yaml.safe_load_all(target.read_text()) if body]
    for generator in kustomization.get("configMapGenerator", []):
        assert generator.get("options", {}).get("disableNameSuffixHash"), "hash suffixes are not rendered here"
        objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": generator["name"], "labels": generator["options"].get("labels", {})},
                        "data": {Path(f).name: (directory / f).read_text() for f in generator["files"]}})
    if "namespace" in kustomization:
        for body in objects:
            body["metadata"]["namespace"] = kustomization["namespace"]
            for subject in body.get("subjects", []) if body["kind"] == "RoleBinding" else []:
                subject["namespace"] = kustomization["namespace"]
    for image in kustomization.get("images", []):
        for body in objects:
            if body["kind"] in WORKLOAD_KINDS:
                for container in containers(Obj(directory, body)):
                    if re.split(r"[:@]", container["image"], maxsplit=1)[0] == image["name"]:
                        container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        for body in objects:
            if body["kind"] == target["kind"] and body["metadata"]["name"] == target["name"]:
                for op in yaml.safe_load(patch["patch"]):
                    _json_pointer_apply(body, op)
    return objects


@pytest.fixture(scope="module")
def rendered() -> list[Obj]:
    """The example overlay as it will be applied: `kubectl kustomize`, or the renderer above."""
    bodies = kubectl_kustomize(OVERLAY) if shutil.which("kubectl") else render_kustomization(OVERLAY)
    return [Obj(OVERLAY / "kustomization.yaml", body) for body in bodies]


@pytest.mark.parametrize("directory", [BASE, OVERLAY], ids=["base", "overlay"])
def test_the_renderer_renders_what_kubectl_kustomize_renders(directory: Path):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with its built-in Kustomize) is not installed")
    key = lambda body: (body["kind"], body["metadata"]["name"])  # noqa: E731
    ours = {key(b): b for b in render_kustomization(directory)}
    theirs = {key(b): b for b in kubectl_kustomize(directory)}
    assert ours == theirs


def test_the_overlay_renders_every_base_object(rendered: list[Obj]):
    ours = {(o.kind, o.name) for o in OBJECTS} | {("ConfigMap", "modelplane-dagster-instance")}
    assert {(o.kind, o.name) for o in rendered} == ours


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_rendered_overlay_is_valid_for_kubernetes(rendered: list[Obj], version: str):
    errors = {str(o): validate(o.body, version) for o in rendered}
    assert {name: e for name, e in errors.items() if e} == {}


def test_the_overlay_puts_everything_in_its_namespace(rendered: list[Obj]):
    namespace = _load(OVERLAY / "kustomization.yaml")["namespace"]
    assert {o.body["metadata"].get("namespace") for o in rendered} == {namespace}
    for binding in of_kind("RoleBinding", rendered):
        assert {s["namespace"] for s in binding.body["subjects"]} == {namespace}


def test_the_overlay_runs_one_image_everywhere(rendered: list[Obj]):
    """Containers, Dagster's run workers (MODELPLANE_IMAGE) and the replicas
    (MODELPLANE_K8S_RUNTIME_IMAGE): Kustomize's `images` rewrites only the first."""
    image = _load(OVERLAY / "kustomization.yaml")["images"][0]
    expected = f"{image['newName']}:{image['newTag']}"
    used = {c["image"] for o in rendered if o.kind in WORKLOAD_KINDS for c in containers(o)}
    assert used == {expected}
    config = named("ConfigMap", "modelplane-config", rendered).body["data"]
    assert config["MODELPLANE_IMAGE"] == config["MODELPLANE_K8S_RUNTIME_IMAGE"] == expected
    assert config["MODELPLANE_REGISTRY_URL"], "an installation must name its OCI registry"


def test_the_overlay_runs_active_active_routers(rendered: list[Obj]):
    assert named("Deployment", "modelplane-router", rendered).body["spec"]["replicas"] >= 2


# -- components: the commands `modelplane up` uses ---------------------------------------------
def _program(argv: list[str]) -> tuple[str, ...]:
    """What a command runs: ("python", "-m", module) or (program, first subcommand)."""
    name = Path(argv[0]).name
    if name.startswith("python"):
        return ("python", "-m", argv[argv.index("-m") + 1])
    return (name, argv[1]) if len(argv) > 1 and not argv[1].startswith("-") else (name,)


def test_components_run_the_commands_modelplane_up_runs(tmp_path, monkeypatch):
    from controlplane.services import build_services
    from controlplane.settings import Settings

    monkeypatch.setenv("MODELPLANE_HOME", str(tmp_path))
    monkeypatch.setenv("MODELPLANE_REGISTRY_URL", "http://registry.invalid")  # no embedded registry on a cluster
    local = {s.name: _program(s.argv) for s in build_services(Settings.from_env())}
    local.pop("supervisor")  # Kubernetes runs the replicas
    # On a cluster the webserver and the daemon load the code location themselves
    # (docs/kubernetes.md, "What differs from `modelplane up`").
    local.pop("dagster-code-server")
    on_cluster = {component(o): _program(pod_spec(o)["containers"][0]["command"]) for o in of_kind("Deployment")}
    assert on_cluster == local


def test_the_settings_the_manifests_give_are_ones_modelplane_accepts():
    from controlplane.settings import Settings

    data = named("ConfigMap", "modelplane-config").body["data"]
    settings = Settings.from_env({**data, "MODELPLANE_K8S_NAMESPACE": "modelplane",
                                  "MODELPLANE_DATABASE_URL": "postgresql://modelplane@db:5432/modelplane"})
    assert settings.cluster == "kubernetes"
    assert settings.host == "0.0.0.0"  # reachable through the Services
    assert str(settings.home) == data["MODELPLANE_HOME"]
    assert settings.k8s_runtime_image == data["MODELPLANE_IMAGE"]
    named("PersistentVolumeClaim", settings.k8s_models_claim)
    for setting, service in (("MLFLOW_TRACKING_URI", "modelplane-mlflow"), ("MODELPLANE_ROUTER_URL", "modelplane-router")):
        assert data[setting] == f"http://{service}:{SERVICE_PORTS[service]}"
    assert settings.mlflow_tracking_uri == data["MLFLOW_TRACKING_URI"]
    assert settings.router_url == data["MODELPLANE_ROUTER_URL"]  # run workers and sensors reach the router there


def test_routers_advertise_their_pod_ip():
    """Each router reports http://$MODELPLANE_ADVERTISE_HOST:<its own port> in the routers table."""
    from controlplane.settings import Settings

    [container] = pod_spec(named("Deployment", "modelplane-router"))["containers"]
    [entry] = [e for e in container["env"] if e["name"] == "MODELPLANE_ADVERTISE_HOST"]
    assert entry["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    data = named("ConfigMap", "modelplane-config").body["data"]
    settings = Settings.from_env({**data, "MODELPLANE_ADVERTISE_HOST": "10.1.2.3",
                                  "MODELPLANE_DATABASE_URL": "postgresql://modelplane@db:5432/modelplane"})
    assert settings.advertise_host == "10.1.2.3"


def test_pods_that_call_the_api_name_their_own_namespace(run_worker: Obj):
    """From the downward API: the overlay's `namespace:` is the only place that names it."""
    for workload in workloads(run_worker):
        if not pod_spec(workload)["automountServiceAccountToken"]:
            continue
        for container in pod_spec(workload)["containers"]:
            [entry] = [e for e in container["env"] if e["name"] == "MODELPLANE_K8S_NAMESPACE"]
            assert entry["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace", str(workload)


def test_the_webserver_and_daemon_load_the_checkouts_workspace():
    for name in ("modelplane-dagster-webserver", "modelplane-dagster-daemon"):
        command = pod_spec(named("Deployment", name))["containers"][0]["command"]
        assert command[command.index("-w") + 1] == "/app/workspace.yaml"


def test_services_use_the_ports_modelplane_up_uses():
    from controlplane.settings import Ports

    ports = Ports()
    assert SERVICE_PORTS == {"modelplane-router": ports.router_port, "modelplane-admin-api": ports.admin_port,
                             "modelplane-dagster-webserver": ports.dagster_port, "modelplane-mlflow": ports.mlflow_port}


@pytest.mark.parametrize("name", SERVICE_PORTS)
def test_each_service_reaches_its_component_on_its_port(name: str):
    service = named("Service", name).body
    [port] = service["spec"]["ports"]
    assert port["port"] == SERVICE_PORTS[name]
    selected = [o for o in of_kind("Deployment")
                if service["spec"]["selector"].items() <= o.body["spec"]["template"]["metadata"]["labels"].items()]
    assert [o.name for o in selected] == [name]
    [container] = pod_spec(selected[0])["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[port["targetPort"]] == SERVICE_PORTS[name]


def test_routers_are_active_active_and_keep_one_up_through_disruptions():
    router = named("Deployment", "modelplane-router").body
    assert router["spec"]["replicas"] >= 2
    assert router["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    budget = named("PodDisruptionBudget", "modelplane-router").body["spec"]
    assert budget["minAvailable"] == 1
    assert budget["selector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]


def test_autoscalers_elect_their_leader_through_the_control_plane_database_only():
    """Two pods; the one holding the database lease `autoscaler` (controlplane/scaling.py, on
    PostgreSQL, seen by every pod) scales, the other stands by. No Kubernetes Lease."""
    from controlplane.scaling import AUTOSCALER_LEASE

    autoscaler = named("Deployment", "modelplane-autoscaler")
    assert autoscaler.body["spec"]["replicas"] == 2
    [container] = pod_spec(autoscaler)["containers"]
    assert "MODELPLANE_DATABASE_URL" in {e["name"] for e in container["env"]}
    assert AUTOSCALER_LEASE == "autoscaler"
    for role in of_kind("Role"):
        assert not [p for p in _permissions(role.body["rules"]) if p[0] == "coordination.k8s.io"], str(role)
    for path in [*DEPLOY.rglob("*"), DOCS]:
        if path.is_file():
            assert "MODELPLANE_LEADER_ELECTION" not in path.read_text(errors="replace"), str(path)


def _heartbeat_probe_passes(command: list[str], heartbeat: Path) -> bool:
    env = {"PATH": "/usr/bin:/bin", "MODELPLANE_HEARTBEAT_FILE": str(heartbeat)}
    return subprocess.run(command, env=env, capture_output=True, timeout=10).returncode == 0


def test_the_autoscalers_liveness_probe_fails_on_a_heartbeat_older_than_60_seconds(tmp_path):
    """The control loop touches $MODELPLANE_HEARTBEAT_FILE on every pass, leader or standby
    (autoscale/controller/__main__.py); the probe runs here as the kubelet runs it."""
    import os
    import time

    [container] = pod_spec(named("Deployment", "modelplane-autoscaler"))["containers"]
    [path] = [e["value"] for e in container["env"] if e["name"] == "MODELPLANE_HEARTBEAT_FILE"]
    assert Path(path).parent.as_posix() in {m["mountPath"] for m in container["volumeMounts"]}  # writable
    assert "MODELPLANE_HEARTBEAT_FILE" in (REPO / "autoscale" / "controller" / "__main__.py").read_text()
    heartbeat = tmp_path / "heartbeat"
    for probe in ("startupProbe", "livenessProbe"):
        command = container[probe]["exec"]["command"]
        assert not _heartbeat_probe_passes(command, heartbeat), probe  # not written yet
        heartbeat.touch()
        assert _heartbeat_probe_passes(command, heartbeat), probe
        os.utime(heartbeat, (time.time() - 90, time.time() - 90))
        assert not _heartbeat_probe_passes(command, heartbeat), probe
        heartbeat.unlink()


@pytest.mark.parametrize("name", ["modelplane-dagster-daemon", "modelplane-mlflow"])
def test_singletons_are_replaced_never_doubled(name: str):
    """One Dagster daemon per instance; one MLflow on a ReadWriteOnce volume."""
    spec = named("Deployment", name).body["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["type"] == "Recreate"


def test_mlflow_serves_artifacts_from_its_volume_and_its_registry_from_postgresql():
    mlflow = pod_spec(named("Deployment", "modelplane-mlflow"))
    args = mlflow["containers"][0]["args"]
    assert args[args.index("--backend-store-uri") + 1].startswith("postgresql://")
    destination = args[args.index("--artifacts-destination") + 1]
    assert "--serve-artifacts" in args
    mounts = {m["mountPath"]: m["name"] for m in mlflow["containers"][0]["volumeMounts"]}
    volume = next(v for v in mlflow["volumes"] if v["name"] == mounts[str(Path(destination).parent)])
    named("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])


# -- Dagster ---------------------------------------------------------------------------------
def test_dagster_yaml_is_a_valid_dagster_instance(tmp_path):
    from dagster._core.instance.config import dagster_instance_config

    shutil.copy(DAGSTER_YAML, tmp_path / "dagster.yaml")
    config, _ = dagster_instance_config(str(tmp_path))  # raises DagsterInvalidConfigError on a bad key
    assert set(config["storage"]) == {"postgres"}
    assert config["run_launcher"]["module"] == "dagster_k8s"
    assert config["run_launcher"]["class"] == "K8sRunLauncher"


def test_dagster_yaml_reads_everything_secret_or_namespaced_from_the_environment():
    instance = dagster_instance()
    db = instance["storage"]["postgres"]["postgres_db"]
    assert all(isinstance(value, dict) and set(value) == {"env"} for value in db.values()), db
    launcher = instance["run_launcher"]["config"]
    assert launcher["job_namespace"] == {"env": "MODELPLANE_K8S_NAMESPACE"}
    assert launcher["job_image"] == {"env": "MODELPLANE_IMAGE"}
    assert launcher["load_incluster_config"] is True


@pytest.mark.parametrize("section", ["local_artifact_storage", "compute_logs"])
def test_dagster_yaml_classes_exist_and_accept_their_config(section: str):
    import importlib

    from dagster._config import process_config

    spec = dagster_instance()[section]
    cls = getattr(importlib.import_module(spec["module"]), spec["class"])
    assert process_config(cls.config_type(), spec.get("config", {})).success


def test_the_run_worker_shares_its_state_with_later_runs(run_worker: Obj):
    """Step outputs (the filesystem IO manager) and $MODELPLANE_HOME live on the shared claim."""
    spec = pod_spec(run_worker)
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
    home = named("ConfigMap", "modelplane-config").body["data"]["MODELPLANE_HOME"]
    claim = named("PersistentVolumeClaim", claims[mounts[home]]).body
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # two runs at once, maybe on two nodes
    storage = dagster_instance()["local_artifact_storage"]["config"]["base_dir"]
    assert Path(storage).is_relative_to(home)


def test_the_run_worker_gets_the_instance_and_the_image_the_launcher_names(run_worker: Obj):
    spec = pod_spec(run_worker)
    [container] = spec["containers"]
    assert container["image"] == RUN_LAUNCHER_ENV["MODELPLANE_IMAGE"]
    config_maps = {v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v}
    assert dagster_instance()["run_launcher"]["config"]["instance_config_map"] in config_maps
    assert container["args"][:3] == ["dagster", "api", "execute_run"]


# -- security: identities and tokens ----------------------------------------------------------
#: Pods that call the Kubernetes API, and so mount a service account token.
CALLS_THE_API = {"router": True, "autoscaler": True, "admin-api": False, "mlflow": False,
                 "dagster-webserver": True, "dagster-daemon": True, "run-worker": True}


def test_every_workload_runs_as_a_service_account_of_its_own(run_worker: Obj):
    accounts = {}
    for workload in workloads(run_worker):
        account = pod_spec(workload).get("serviceAccountName")
        assert account not in (None, "", "default"), f"{workload} runs as the namespace's default account"
        assert account not in accounts, f"{workload} shares {account} with {accounts.get(account)}"
        accounts[account] = str(workload)
        named("ServiceAccount", account)


def test_no_service_account_hands_out_tokens_by_default():
    for account in of_kind("ServiceAccount"):
        assert account.body.get("automountServiceAccountToken") is False, str(account)


def test_tokens_are_mounted_only_where_the_kubernetes_api_is_called(run_worker: Obj):
    mounted = {component(w): pod_spec(w).get("automountServiceAccountToken") for w in workloads(run_worker)}
    assert mounted == CALLS_THE_API


def test_a_pod_with_a_token_has_a_role_and_a_pod_without_one_has_none(run_worker: Obj):
    bound = {s["name"] for b in of_kind("RoleBinding") for s in b.body["subjects"]}
    for workload in workloads(run_worker):
        spec = pod_spec(workload)
        assert bool(spec["automountServiceAccountToken"]) == (spec["serviceAccountName"] in bound), str(workload)
    assert "modelplane-replica" not in bound  # replicas run whatever model was registered


def test_replica_pods_run_as_the_shipped_account_without_a_token_or_a_role():
    """The Deployments the cluster backend generates name the account deploy/ ships for them."""
    from cluster.kubernetes.config import KubernetesConfig
    from cluster.kubernetes.manifests import deployment
    from cluster.protocol import RevisionSpec

    config = KubernetesConfig(home_path="/var/lib/modelplane")
    revision = RevisionSpec("iris-v1-aa", "iris", "/var/lib/modelplane/models/iris/v1", "pyfunc", 1, {})
    pod = deployment(revision, config)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == config.service_account == "modelplane-replica"
    assert pod["automountServiceAccountToken"] is False
    account = named("ServiceAccount", pod["serviceAccountName"])
    assert account.body["automountServiceAccountToken"] is False
    assert _account_permissions()[account.name] == set()


# -- security: RBAC ------------------------------------------------------------------------------
def _permissions(rules: list[dict]) -> set[tuple[str, str, str, str]]:
    """(apiGroup, resource, verb, resourceName or "*") for every combination a Role grants."""
    return {(group, resource, verb, name)
            for rule in rules for group in rule["apiGroups"] for resource in rule["resources"]
            for verb in rule["verbs"] for name in rule.get("resourceNames", ["*"])}


def _grant(group: str, resource: str, *verbs: str, name: str = "*") -> set[tuple[str, str, str, str]]:
    return {(group, resource, verb, name) for verb in verbs}


#: What the cluster backend's callers are granted (cluster/kubernetes/backend.py, discovery.py):
#: exactly the calls their processes make, which test_each_role_grants_exactly_the_calls_its_callers_make
#: records against the API mock server.
SERVICE_READ = _grant("", "services", "get")  # revision_of: the Service's modelplane.io/revision-id
ROUTER = _grant("discovery.k8s.io", "endpointslices", "list", "watch") | SERVICE_READ
RUN_LAUNCHER = (_grant("batch", "jobs", "create", "get", "list", "watch", "delete")
                | _grant("", "pods", "get", "list", "watch") | _grant("", "pods/log", "get"))
CLUSTER_BACKEND = (_grant("apps", "deployments", "list", "create", "patch", "delete")  # create: apply of an absent object
                   | _grant("", "services", "get", "list", "create", "patch", "delete")
                   | _grant("policy", "poddisruptionbudgets", "list", "create", "patch", "delete")
                   | _grant("discovery.k8s.io", "endpointslices", "list"))
AUTOSCALER = (_grant("apps", "deployments/scale", "get", "update")  # read, then replace with its resourceVersion
              | _grant("discovery.k8s.io", "endpointslices", "list") | SERVICE_READ
              | _grant("", "pods", "list", "patch"))  # pod-deletion-cost of the replicas to stop first

ROLES = {"modelplane-router": ROUTER, "modelplane-autoscaler": AUTOSCALER,
         "modelplane-run-launcher": RUN_LAUNCHER, "modelplane-cluster-backend": CLUSTER_BACKEND}

#: What each service account may do, all its RoleBindings together.
ACCOUNTS = {"modelplane-router": ROUTER, "modelplane-autoscaler": AUTOSCALER,
            "modelplane-dagster-webserver": RUN_LAUNCHER, "modelplane-dagster-daemon": RUN_LAUNCHER | CLUSTER_BACKEND,
            "modelplane-run-worker": CLUSTER_BACKEND, "modelplane-admin-api": set(), "modelplane-mlflow": set(),
            "modelplane-replica": set()}


def test_rbac_is_namespaced():
    assert of_kind("ClusterRole") == [] and of_kind("ClusterRoleBinding") == []
    for binding in of_kind("RoleBinding"):
        assert binding.body["roleRef"]["kind"] == "Role", str(binding)


@pytest.mark.parametrize("role", ROLES)
def test_each_role_grants_exactly_its_rules(role: str):
    assert _permissions(named("Role", role).body["rules"]) == ROLES[role]


def test_no_role_grants_wildcards_secrets_or_escalation():
    for role in of_kind("Role"):
        for group, resource, verb, _ in _permissions(role.body["rules"]):
            assert "*" not in (group, resource, verb), str(role)
            assert resource not in ("secrets", "roles", "rolebindings", "serviceaccounts/token", "pods/exec"), str(role)
            assert verb not in ("escalate", "bind", "impersonate"), str(role)


def test_routers_may_only_watch_endpointslices_and_read_services():
    assert _account_permissions()["modelplane-router"] == (
        _grant("discovery.k8s.io", "endpointslices", "list", "watch") | _grant("", "services", "get"))


def _account_permissions() -> dict[str, set]:
    roles = {r.name: _permissions(r.body["rules"]) for r in of_kind("Role")}
    granted = {a.name: set() for a in of_kind("ServiceAccount")}
    for binding in of_kind("RoleBinding"):
        for subject in binding.body["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["name"] in granted, str(binding)
            granted[subject["name"]] |= roles[binding.body["roleRef"]["name"]]
    return granted


def test_each_service_account_may_do_exactly_what_its_component_needs():
    assert _account_permissions() == ACCOUNTS


#: The API calls each identity's processes make, as (apiGroup, resource, verb), recorded below.
def _calls(kube, user_agent: str) -> set[tuple[str, str, str]]:
    """What the API server authorizes for the requests one client sent (kmock's request log):
    a server-side apply is a patch, and a create when the object does not exist yet."""
    calls = set()
    for request in kube.handler:
        agent = next((v for k, v in request.headers.items() if k.lower() == "user-agent"), "")
        if agent != user_agent or request.resource is None:
            continue
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        method = request.method.value.upper()
        if method == "GET":
            verbs = ["watch"] if str(request.params.get("watch", "")).lower() in ("true", "1") else \
                ["get"] if request.name else ["list"]
        else:
            verbs = {"POST": ["create"], "PUT": ["update"], "DELETE": ["delete" if request.name else "deletecollection"],
                     "PATCH": ["patch"]}[method]
            content_type = next((v for k, v in request.headers.items() if k.lower() == "content-type"), "")
            if content_type.startswith("application/apply-patch"):
                verbs.append("create")
        calls |= {(request.resource.group, resource, verb) for verb in verbs}
    return calls


@pytest.fixture(scope="module")
def backend_calls() -> dict[str, set[tuple[str, str, str]]]:
    """Each identity's processes drive the real KubernetesCluster against the API mock server
    (tests/kube_mock), one client (User-Agent) per identity, doing what they do in production:

    - routers (serving/router/app.py, ReplicaFeed): ``watch``, through a list and a change;
    - autoscalers (autoscale/controller/__main__.py): ``desired_replicas``, ``replicas``
      (replica_counts), ``scale`` down with named victims and up again;
    - run workers (assets/served_endpoint.py, assets/cost_model.py, the rollback job) and the
      daemon's sensors (pipelines/sensors.py revision reaper, pipelines/health.py):
      ``apply`` (new and again), ``replicas``, ``delete``, ``converge``.
    """
    from autoscale.controller.sources import replica_counts
    from cluster.kubernetes.backend import KubernetesCluster
    from cluster.kubernetes.config import KubernetesConfig
    from cluster.kubernetes.manifests import object_name
    from cluster.protocol import RevisionSpec
    from tests.kube_mock import KubeMock

    config = KubernetesConfig(namespace="modelplane", home_path="/var/lib/modelplane", watch_timeout_s=2)

    def spec(revision_id: str, replicas: int = 2) -> RevisionSpec:
        return RevisionSpec(revision_id, "iris", f"/var/lib/modelplane/models/iris/{revision_id}", "pyfunc",
                            replicas, {"workers": 1})

    with KubeMock() as kube:
        def as_identity(agent: str) -> KubernetesCluster:  # a process of its own: nothing cached
            client = kube.api_client()
            client.user_agent = agent
            return KubernetesCluster(client, config, sleep=lambda _s: None)

        # run workers: a rollout starts a revision, waits for it, retires the one it replaced
        worker = as_identity("run-worker")
        worker.apply(spec("iris-v1-aa", 3))
        worker.apply(spec("iris-v2-bb", 1))
        worker.apply(spec("iris-v2-bb", 1))  # a retried step: the objects exist
        worker.replicas("iris-v2-bb")
        worker.delete("iris-v1-aa")
        # the daemon's sensors: a health check, the revision reaper's delete and converge
        sensors = as_identity("run-worker")
        replica_counts(sensors, "iris-v2-bb")
        worker.apply(spec("orphan-v1-cc"))
        sensors.delete("iris-v2-bb")
        sensors.converge([spec("iris-v3-dd")])  # finishes a missing revision, deletes the orphan

        # the autoscaler: desired and observed counts, a scale-down that names its victims
        name = object_name("iris-v3-dd")
        kube.emulator.set_all_ready(name)
        autoscaler = as_identity("autoscaler")
        autoscaler.desired_replicas("iris-v3-dd")
        replica_counts(autoscaler, "iris-v3-dd")
        victim = kube.emulator.pods(name)[0]["metadata"]["name"]
        autoscaler.scale("iris-v3-dd", 1, victims=[victim])
        autoscaler.scale("iris-v3-dd", 2)

        # a router: the first list, then a change seen through the watch
        changes = as_identity("router").watch(interval_s=0.01)
        next(changes)
        worker.apply(spec("iris-v4-ee", 1))
        next(changes)
        changes.close()

        return {"modelplane-run-worker": _calls(kube, "run-worker"),
                "modelplane-autoscaler": _calls(kube, "autoscaler"),
                "modelplane-router": _calls(kube, "router")}


def test_each_role_grants_exactly_the_calls_its_callers_make(backend_calls):
    """No verb a process needs is missing (a 403 on a cluster), none is granted that nothing uses."""
    accounts = _account_permissions()
    for account, calls in backend_calls.items():
        assert {name for *_, name in accounts[account]} == {"*"}  # no rule limited to names
        granted = {(group, resource, verb) for group, resource, verb, _ in accounts[account]}
        assert granted == calls, f"{account}: missing {sorted(calls - granted)}, unused {sorted(granted - calls)}"
    # the daemon's sensors call what run workers call, through the same Role
    assert accounts["modelplane-dagster-daemon"] - RUN_LAUNCHER == accounts["modelplane-run-worker"]


def test_the_docs_rbac_table_is_the_roles():
    """docs/kubernetes.md, "Security posture": `group/resource`: verbs; … per Role."""
    documented = {}
    for role, rules in re.findall(r"^\s*\| `(modelplane-[\w-]+)` \| [^|]+ \| (.+) \|$", DOCS.read_text(), re.MULTILINE):
        grants = set()
        for target, verbs in re.findall(r"`([\w./-]+)`: ([\w ,]+)", rules):
            first, _, rest = target.partition("/")
            group, resource = (first, rest) if rest and ("." in first or first in ("apps", "batch", "policy")) else ("", target)
            grants |= _grant(group, resource, *[v.strip() for v in verbs.replace(" and ", ", ").split(",")])
        documented[role] = grants
    assert documented == ROLES


def test_the_run_workers_account_is_the_one_dagster_yaml_names():
    assert dagster_instance()["run_launcher"]["config"]["service_account_name"] == "modelplane-run-worker"


# -- security: credentials ----------------------------------------------------------------------
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|_KEY$|PASSWD|CREDENTIAL", re.IGNORECASE)
CREDENTIAL_IN_URL = re.compile(r"://[^/\s@:]+:[^/\s@]+@")  # scheme://user:password@host


def _env_entries(obj: Obj) -> list[tuple[str, dict]]:
    return [(f"{obj}:{c['name']}", e) for c in containers(obj) for e in c.get("env", [])]


def test_credentials_reach_containers_only_by_secret_reference(run_worker: Obj):
    checked = 0
    for workload in workloads(run_worker):
        for where, entry in _env_entries(workload):
            if SECRET_NAME.search(entry["name"]):
                assert "value" not in entry and "secretKeyRef" in entry.get("valueFrom", {}), f"{where} {entry['name']}"
                checked += 1
            assert not CREDENTIAL_IN_URL.search(entry.get("value", "")), f"{where} {entry['name']}"
    assert checked >= 8  # PGPASSWORD everywhere, MLflow's key, the registry's password


def test_the_database_password_is_pgpassword_and_never_part_of_a_url(run_worker: Obj):
    for workload in workloads(run_worker):
        for where, entry in _env_entries(workload):
            if entry["name"] == "MODELPLANE_DATABASE_URL":
                assert "PASSWORD" not in entry["value"].upper(), where
    args = pod_spec(named("Deployment", "modelplane-mlflow"))["containers"][0]["args"]
    assert "PASSWORD" not in args[args.index("--backend-store-uri") + 1].upper()


#: The databases each component uses, by the settings that name them (PGHOST, PGPORT, PGUSER
#: and PGPASSWORD come with each: libpq reads them).
DATABASES = {
    "router": {"MODELPLANE_DATABASE_URL"},
    "autoscaler": {"MODELPLANE_DATABASE_URL"},
    "admin-api": {"MODELPLANE_DATABASE_URL"},
    "mlflow": {"MLFLOW_PG_DATABASE"},
    "dagster-webserver": {"MODELPLANE_DATABASE_URL", "DAGSTER_PG_DATABASE"},
    "dagster-daemon": {"MODELPLANE_DATABASE_URL", "DAGSTER_PG_DATABASE"},
    "run-worker": {"MODELPLANE_DATABASE_URL", "DAGSTER_PG_DATABASE"},
}
LIBPQ = {"PGHOST", "PGPORT", "PGUSER", "PGPASSWORD"}


def test_each_component_gets_the_databases_it_uses_and_no_other(run_worker: Obj):
    for workload in workloads(run_worker):
        for container in containers(workload):
            names = {e["name"] for e in container.get("env", [])}
            assert names & (set().union(*DATABASES.values()) | LIBPQ) == DATABASES[component(workload)] | LIBPQ, \
                f"{workload}:{container['name']}"


def _walk(value, path=()):
    if isinstance(value, dict):
        for key, item in value.items():
            yield path + (str(key),), key, item
            yield from _walk(item, path + (str(key),))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _walk(item, path + (str(index),))


def test_no_plaintext_secret_anywhere_in_deploy():
    assert of_kind("Secret") == [], "Secrets are created by the operator (docs/kubernetes.md), never shipped"
    documents = [(str(o), o.body) for o in OBJECTS] + [("dagster.yaml", dagster_instance())]
    for where, document in documents:
        for path, key, value in _walk(document):
            if isinstance(key, str) and re.search(r"password|passwd|secret_?key|token$", key, re.IGNORECASE):
                assert not (isinstance(value, str) and value), f"{where}: {'.'.join(path)}"
            if isinstance(value, str):
                assert not CREDENTIAL_IN_URL.search(value), f"{where}: {'.'.join(path)}"
    for config_map in of_kind("ConfigMap"):
        assert not [k for k in config_map.body.get("data", {}) if SECRET_NAME.search(k)], str(config_map)
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert not re.search(r"^\s*(ENV|ARG)\s+\S*(PASSWORD|SECRET|TOKEN)", dockerfile, re.IGNORECASE | re.MULTILINE)


def _secret_keys_referenced(run_worker: Obj) -> set[tuple[str, str]]:
    refs = set()
    for workload in workloads(run_worker):
        for _, entry in _env_entries(workload):
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                refs.add((ref["name"], ref["key"]))
        for volume in pod_spec(workload).get("volumes", []):
            if "secret" in volume:
                refs |= {(volume["secret"]["secretName"], item["key"]) for item in volume["secret"]["items"]}
    return refs


def test_every_secret_key_the_manifests_read_is_one_the_docs_create(run_worker: Obj):
    created = set()
    for line in DOCS.read_text().replace("\\\n", " ").splitlines():  # shell continuations joined
        command = re.search(r"create secret generic (\S+)(.*)", line)
        if command:
            created |= {(command[1], key) for key in re.findall(r"--from-(?:literal|file)=([\w.-]+)=", command[2])}
    assert _secret_keys_referenced(run_worker) <= created, sorted(_secret_keys_referenced(run_worker) - created)


# -- security: containers ----------------------------------------------------------------------------
def _all_containers(run_worker: Obj) -> list[tuple[str, dict, dict]]:
    return [(f"{w}:{c['name']}", c, pod_spec(w)) for w in workloads(run_worker) for c in containers(w)]


def test_every_container_has_cpu_and_memory_requests_and_limits(run_worker: Obj):
    for where, container, _ in _all_containers(run_worker):
        resources = container.get("resources", {})
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources.get(bound, {})), f"{where} {bound}"


def test_every_container_runs_as_a_non_root_user_without_privileges(run_worker: Obj):
    for where, container, pod in _all_containers(run_worker):
        pod_context, context = pod.get("securityContext", {}), container.get("securityContext", {})
        assert pod_context.get("runAsNonRoot") is True and pod_context.get("runAsUser", 0) != 0, where
        assert pod_context.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        assert context.get("runAsNonRoot") is True, where
        assert context.get("allowPrivilegeEscalation") is False, where
        assert context.get("capabilities", {}).get("drop") == ["ALL"] and not context["capabilities"].get("add"), where
        assert not context.get("privileged"), where
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), where


#: Containers whose root filesystem stays writable, and why. Every component allows a
#: read-only one: what they write goes to /tmp, $MODELPLANE_HOME or $DAGSTER_HOME volumes.
WRITABLE_ROOT: dict[str, str] = {}


def test_root_filesystems_are_read_only_with_a_writable_tmp(run_worker: Obj):
    for where, container, _ in _all_containers(run_worker):
        if container["name"] in WRITABLE_ROOT:
            continue
        assert container.get("securityContext", {}).get("readOnlyRootFilesystem") is True, where
        assert "/tmp" in {m["mountPath"] for m in container.get("volumeMounts", [])}, where


def test_the_image_runs_as_the_numeric_non_root_user_the_pods_name():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    [user] = re.findall(r"^USER\s+(\S+)", dockerfile, re.MULTILINE)
    uid = int(user.split(":")[0])  # numeric: the kubelet can check runAsNonRoot against it
    assert uid != 0
    for workload in workloads():
        assert pod_spec(workload)["securityContext"]["runAsUser"] == uid, str(workload)
    assert not re.search(r"^ENTRYPOINT", dockerfile, re.MULTILINE)  # run workers pass their command as args


def test_the_image_installs_the_locked_environments_like_make():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    makefile = (REPO / "Makefile").read_text()
    assert re.findall(r"^FROM\s+(\S+)", dockerfile, re.MULTILINE) == ["python:3.11-slim-bookworm"]
    installer = (REPO / "scripts" / "install-locked.sh").read_text()
    assert installer.count("--no-deps") == 2 and '-r "$lock"' in installer  # uv, else pip: the lock alone …
    for lock in ("requirements/main.lock", "requirements/quantize.lock"):
        assert re.search(rf"scripts/install-locked.sh \S+ {re.escape(lock)} \$\(TORCH_INDEX_URL\)", makefile)  # … in make
        assert re.search(rf"pip install -q --no-deps --extra-index-url \S+ -r {re.escape(lock)}", dockerfile)  # … and the image
    assert "uninstall -q -y torchvision torchaudio torchcodec" in dockerfile
    assert "install -q --no-deps --no-build-isolation -e ." in dockerfile
    # What the Dagster pods need besides the lock (dagster-k8s is in it), pinned, and never a
    # second pin of something the lock pins: it would silently replace the locked version.
    instructions = "\n".join(line for line in dockerfile.splitlines() if not line.lstrip().startswith("#"))
    extra = dict(re.findall(r"\b([A-Za-z][\w.-]*)==(\d[^\s\\]*)", instructions))
    assert {"dagster-postgres", "psycopg2-binary"} <= set(extra)
    locked = {re.sub(r"[-_.]+", "-", name).lower() for name, _ in
              re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO / "requirements/main.lock").read_text(), re.MULTILINE)}
    assert {re.sub(r"[-_.]+", "-", name).lower() for name in extra} & locked == set()


# -- probes ---------------------------------------------------------------------------------------
#: Long-running containers that serve HTTP get readiness; all get liveness.
SERVES_TRAFFIC = {"router", "admin-api", "dagster-webserver", "mlflow"}


@pytest.mark.parametrize("deployment", of_kind("Deployment"), ids=str)
def test_every_long_running_container_is_probed(deployment: Obj):
    for container in pod_spec(deployment)["containers"]:
        assert "livenessProbe" in container, f"{deployment}:{container['name']}"
        if component(deployment) in SERVES_TRAFFIC:
            assert "readinessProbe" in container, f"{deployment}:{container['name']}"


def test_liveness_never_depends_on_the_database_answering():
    """The admin API's /healthz runs SELECT 1: fine for readiness, but as liveness a database
    outage would restart every pod at once."""
    admin = pod_spec(named("Deployment", "modelplane-admin-api"))["containers"][0]
    assert admin["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert "httpGet" not in admin["livenessProbe"]


def test_every_named_probe_port_exists():
    for deployment in of_kind("Deployment"):
        for container in pod_spec(deployment)["containers"]:
            names = {p["name"] for p in container.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                action = container.get(probe, {}).get("httpGet") or container.get(probe, {}).get("tcpSocket")
                if action and isinstance(action["port"], str):
                    assert action["port"] in names, f"{deployment}:{container['name']} {probe}"


# -- references between objects ---------------------------------------------------------------------
def test_every_referenced_configmap_claim_and_account_exists(run_worker: Obj):
    config_maps = {o.name for o in of_kind("ConfigMap")} | {
        g["name"] for k in kustomizations() for g in _load(k).get("configMapGenerator", [])}
    claims = {o.name for o in of_kind("PersistentVolumeClaim")}
    for workload in workloads(run_worker):
        spec = pod_spec(workload)
        for container in containers(workload):
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps, str(workload)
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, str(workload)
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, str(workload)
        names = {v["name"] for v in spec.get("volumes", [])}
        for container in containers(workload):
            assert {m["name"] for m in container.get("volumeMounts", [])} <= names, str(workload)


def test_env_references_are_defined_before_use(run_worker: Obj):
    """Kubernetes expands $(VAR) only from variables earlier in the same list (or envFrom)."""
    config = set(named("ConfigMap", "modelplane-config").body["data"])
    for workload in workloads(run_worker):
        for container in containers(workload):
            defined = set(config) if container.get("envFrom") else set()
            for entry in container.get("env", []):
                for used in re.findall(r"\$\((\w+)\)", entry.get("value", "")):
                    assert used in defined, f"{workload}:{container['name']} {entry['name']} uses $({used})"
                defined.add(entry["name"])
            for argument in container.get("args", []) + container.get("command", []):
                for used in re.findall(r"\$\((\w+)\)", argument):
                    assert used in defined, f"{workload}:{container['name']} {argument}"
