"""The objects the Kubernetes backend generates for a revision: valid on the three newest API
versions, and saying what the spec says (resources, probes, drain, ownership, labels)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import pytest

from cluster.kubernetes import probes
from cluster.kubernetes.config import MANAGED_BY, REVISION_ANNOTATION, REVISION_LABEL, KubernetesConfig
from cluster.kubernetes.manifests import (IMAGE_MOUNT, deployment, model_dir_in_pod, object_name, revision_objects,
                                          startup_budget_s)
from cluster.protocol import RevisionSpec
from controlplane.settings import Settings
from serving.runtime.liveness import LivenessConfig
from tests.kube_schemas import K8S_VERSIONS, validate

CONFIG = KubernetesConfig(namespace="serving", runtime_image="registry.example/modelplane:1.0",
                          home_path="/var/lib/modelplane")
IMAGE = {"registry": "http://registry.example:5000", "repo": "modelplane/gec", "tag": "v3",
         "manifest_digest": "sha256:" + "a" * 64, "seekable_digest": "", "runtime": "vllm",
         "python": "/usr/bin/python3", "python_version": "3.11.2",
         "layers": [{"role": "env", "path": "opt/modelplane/env"}, {"role": "model", "path": "opt/modelplane/model"}]}


def spec(**changes) -> RevisionSpec:
    base = dict(revision_id="gec-v3-Ab_12", endpoint="gec", model_dir="/var/lib/modelplane/models/gec/v3/quantized",
                runtime="vllm", replicas=2, runtime_config={"api_server_count": 1, "cpu_cores": 4, "memory_gib": 12,
                                                            "gpus": 1}, image=IMAGE, expected_start_s=40.0)
    return RevisionSpec(**{**base, **changes})


SPECS = {"vllm from its serving image": spec(),
         "pyfunc from the shared models volume": spec(runtime="pyfunc", image=None, runtime_config={"workers": 2},
                                                      expected_start_s=None)}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("case", sorted(SPECS))
def test_every_generated_object_validates_against_the_kubernetes_schemas(case, version):
    for obj in revision_objects(SPECS[case], CONFIG, owner_uid="9f0c3c1e-1111-4222-8333-444455556666"):
        assert validate(obj, version) == [], (obj["kind"], version)


def test_a_revisions_objects_share_its_name_labels_and_annotation_and_the_deployment_owns_the_rest():
    objects = revision_objects(spec(), CONFIG, owner_uid="uid-1")
    assert [o["kind"] for o in objects] == ["Deployment", "Service", "PodDisruptionBudget"]
    for obj in objects:
        meta = obj["metadata"]
        assert meta["name"] == object_name("gec-v3-Ab_12") and meta["namespace"] == "serving"
        assert MANAGED_BY.items() <= meta["labels"].items() and meta["labels"][REVISION_LABEL] == meta["name"]
        assert meta["annotations"][REVISION_ANNOTATION] == "gec-v3-Ab_12"
    assert all(o["metadata"]["ownerReferences"] == [{"apiVersion": "apps/v1", "kind": "Deployment",
                                                     "name": object_name("gec-v3-Ab_12"), "uid": "uid-1",
                                                     "controller": True, "blockOwnerDeletion": True}]
               for o in objects[1:])
    service, budget = objects[1]["spec"], objects[2]["spec"]
    assert service["selector"] == budget["selector"]["matchLabels"] == objects[0]["spec"]["selector"]["matchLabels"]


def test_resources_come_from_the_spec_and_threads_from_the_cpu_limit():
    container = deployment(spec(), CONFIG)["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"cpu": "4000m", "memory": "12288Mi", "nvidia.com/gpu": "1"}
    assert container["resources"]["requests"] == container["resources"]["limits"]  # Guaranteed QoS
    assert {"name": "OMP_NUM_THREADS", "value": "4"} in container["env"]
    defaults = deployment(spec(runtime_config={}), CONFIG)["spec"]["template"]["spec"]["containers"][0]
    assert defaults["resources"]["limits"] == {"cpu": "2000m", "memory": "8192Mi"}


def test_the_startup_budget_is_sized_from_the_measured_time_to_ready():
    probe = deployment(spec(expected_start_s=100.0), CONFIG)["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] == startup_budget_s(100.0, CONFIG) == 300
    unmeasured = deployment(spec(expected_start_s=None), CONFIG)["spec"]["template"]["spec"]["containers"][0]
    assert unmeasured["startupProbe"]["periodSeconds"] * unmeasured["startupProbe"]["failureThreshold"] == 900


def test_readiness_is_the_model_loaded_liveness_is_forward_progress_and_stopping_drains_first():
    pod = deployment(spec(), CONFIG)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    live = container["livenessProbe"]["exec"]["command"]
    assert live[:4] == ["python", "-m", "cluster.kubernetes.probes", "live"] and "--state" in live
    assert json.loads(live[live.index("--liveness") + 1]) == dataclasses.asdict(CONFIG.liveness)
    drain = container["lifecycle"]["preStop"]["exec"]["command"]
    assert drain[:4] == ["python", "-m", "cluster.kubernetes.probes", "drain"]
    assert int(drain[drain.index("--timeout-s") + 1]) < pod["terminationGracePeriodSeconds"]
    assert pod["serviceAccountName"] == "modelplane-replica" and pod["automountServiceAccountToken"] is False


def test_the_model_comes_from_the_serving_image_volume_or_the_shared_home_and_nowhere_else():
    pod = deployment(spec(), CONFIG)["spec"]["template"]["spec"]
    [image_volume] = [v for v in pod["volumes"] if "image" in v]
    assert image_volume["image"]["reference"] == "registry.example:5000/modelplane/gec@sha256:" + "a" * 64
    launch = pod["containers"][0]["command"]
    assert launch[launch.index("--model-dir") + 1] == f"{IMAGE_MOUNT}/opt/modelplane/model"
    assert json.loads(launch[launch.index("--config-json") + 1])["cpu_cores"] == 4
    assert model_dir_in_pod(spec(image=None), CONFIG) == "/var/lib/modelplane/models/gec/v3/quantized"
    with pytest.raises(ValueError, match="serving image or from the shared models volume"):
        model_dir_in_pod(spec(image=None, model_dir="/home/me/model"), CONFIG)


def test_names_are_dns_labels_even_for_long_or_odd_revision_ids():
    for revision_id in ("gec-v3-ab12", "Tiny_LLM.v2", "x" * 200, "gec-v10-cost-1790000000"):
        name = object_name(revision_id)
        assert len(name) <= 63 and name == name.lower() and name[0].isalnum() and name[-1].isalnum()
    assert object_name("a_b") != object_name("a-b")  # a hash keeps cleaned-up ids apart


def test_a_bad_install_config_is_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="namespace 'Bad_NS' is not a DNS label"):
        KubernetesConfig(namespace="Bad_NS")
    with pytest.raises(ValueError, match="termination_grace_s must exceed drain_settle_s"):
        KubernetesConfig(termination_grace_s=5, drain_settle_s=5)


def test_the_liveness_probe_judges_by_the_platforms_liveness_settings():
    settings = Settings.from_env({"MODELPLANE_HOME": "/tmp/mp", "MODELPLANE_LIVENESS_HANG_AFTER_S": "50",
                                  "MODELPLANE_LIVENESS_UNANSWERED_AFTER_S": "45"})
    config = replace(CONFIG, liveness=settings.liveness())
    live = deployment(spec(), config)["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["exec"]["command"]
    args = probes.parser().parse_args(live[3:])
    assert LivenessConfig(**json.loads(args.liveness)) == LivenessConfig(hang_after_s=50, unanswered_after_s=45)
