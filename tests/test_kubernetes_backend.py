"""The Kubernetes backend, through the real ``kubernetes`` client, against the API mock server
(tests/kube_mock) whose emulated controllers run each pod as a real HTTP server on loopback.

With ``KUBECONFIG`` pointing at a real cluster, ``test_against_a_real_cluster`` runs the same
contract there (namespace ``MODELPLANE_TEST_NAMESPACE``, default ``modelplane-test``)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import kmock
import pytest

from autoscale.clock import FakeClock
from autoscale.controller.loop import Controller, ControllerConfig, EndpointLoad, EndpointPlan, ReplicaStats
from autoscale.controller.sources import replica_counts, with_desired
from cluster.factory import ReplicaFeed
from cluster.kubernetes.backend import KubernetesCluster
from cluster.kubernetes.config import DELETION_COST, KubernetesConfig
from cluster.kubernetes.discovery import SliceWatcher
from cluster.kubernetes.manifests import object_name
from cluster.protocol import RevisionSpec
from tests.fake_replicas import FakeReplica
from tests.kube_mock import ClusterEmulator, KubeMock

CONFIG = KubernetesConfig(namespace="modelplane", runtime_image="registry.example/modelplane:1.0",
                          home_path="/var/lib/modelplane", watch_timeout_s=2)


def spec(revision_id: str = "iris-v1-aa", replicas: int = 2, endpoint: str = "iris") -> RevisionSpec:
    return RevisionSpec(revision_id, endpoint, f"/var/lib/modelplane/models/{endpoint}/{revision_id}", "pyfunc",
                        replicas, {"workers": 1})


def wait_for(predicate, what: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def kube():
    """The mock API server; each pod it runs is a FakeReplica answering on its own loopback port."""
    servers: dict[str, FakeReplica] = {}

    def address(pod: dict):
        server = FakeReplica(pod["metadata"]["name"]).start()  # .name: the pod that answers at .url
        servers[pod["metadata"]["uid"]] = server
        return "127.0.0.1", server.port

    def removed(pod: dict):
        server = servers.pop(pod["metadata"]["uid"], None)
        if server is not None:
            server.stop()

    with KubeMock(ClusterEmulator(pod_address=address, on_pod_removed=removed)) as mock:
        mock.pods_by_url = lambda: {s.url: s.name for s in list(servers.values())}
        yield mock, KubernetesCluster(mock.api_client(), CONFIG, sleep=lambda _s: None)
    for server in list(servers.values()):
        server.stop()


def requests_to(mock: KubeMock, method: str, fragment: str) -> list:
    return [r for r in mock.requests if r[0].upper() == method and fragment in r[1]]


def test_apply_creates_the_revisions_objects_by_server_side_apply_and_again_changes_nothing(kube):
    mock, cluster = kube
    cluster.apply(spec())
    cluster.apply(spec())  # idempotent
    name = object_name("iris-v1-aa")
    for kind in ("deployments", "services", "poddisruptionbudgets"):
        [obj] = mock.objects(kind, "modelplane")
        assert obj["metadata"]["name"] == name
        assert any(f["manager"] == "modelplane" and f["operation"] == "Apply" for f in obj["metadata"]["managedFields"])
    assert len(mock.emulator.pods(name)) == 2
    [deployment] = mock.objects("deployments", "modelplane")
    owned = [o for kind in ("services", "poddisruptionbudgets") for o in mock.objects(kind, "modelplane")]
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == deployment["metadata"]["uid"] for o in owned)


def test_replicas_are_the_revisions_endpoints_and_only_ready_ones_are_ready(kube):
    mock, cluster = kube
    cluster.apply(spec())
    name = object_name("iris-v1-aa")
    assert [(r.ready, r.state) for r in cluster.replicas("iris-v1-aa")] == [(False, "starting")] * 2
    first, second = (p["metadata"]["name"] for p in mock.emulator.pods(name))
    mock.emulator.set_ready(first)
    replicas = {r.replica_id: r for r in cluster.replicas("iris-v1-aa")}
    assert replicas[first].ready and not replicas[second].ready
    assert replicas[first].revision_id == "iris-v1-aa"  # the id, not the object name
    assert mock.pods_by_url()[replicas[first].url] == first  # each URL is that pod's own server
    assert cluster.replicas("another-revision") == []


def test_scale_goes_through_the_scale_subresource_and_named_victims_go_first(kube):
    mock, cluster = kube
    cluster.apply(spec(replicas=3))
    name = object_name("iris-v1-aa")
    mock.emulator.set_all_ready(name)
    pods = [p["metadata"]["name"] for p in mock.emulator.pods(name)]
    cluster.scale("iris-v1-aa", 1, victims=[pods[0], pods[1]])  # the two oldest, which the controller would keep
    assert requests_to(mock, "PUT", f"/deployments/{name}/scale")
    assert sorted(p["metadata"]["name"] for p in mock.emulator.pods(name, terminating=True)) == sorted(pods[:2])
    assert [p["metadata"]["name"] for p in mock.emulator.pods(name, terminating=False)] == [pods[2]]
    terminating = [r for r in cluster.replicas("iris-v1-aa") if r.state == "terminating"]
    assert len(terminating) == 2 and not any(r.ready for r in terminating)  # never routed to while draining
    cluster.scale("iris-v1-aa", 2)
    [kept] = [p for p in mock.emulator.pods(name, terminating=False) if p["metadata"]["name"] == pods[2]]
    assert DELETION_COST not in (kept["metadata"].get("annotations") or {})  # no stale victim marks
    with pytest.raises(KeyError, match="no revision"):
        cluster.scale("no-such-revision", 1)
    with pytest.raises(ValueError):
        cluster.scale("iris-v1-aa", -1)


def test_a_scale_that_meets_a_concurrent_write_is_retried_on_a_fresh_read(kube):
    mock, cluster = kube
    cluster.apply(spec(replicas=1))
    name = object_name("iris-v1-aa")
    mock.handler["put", kmock.subresource("scale")][:1] << 409
    cluster.scale("iris-v1-aa", 3)
    assert len(requests_to(mock, "PUT", f"/deployments/{name}/scale")) == 2
    assert len(mock.emulator.pods(name)) == 3


def test_delete_removes_the_revision_and_everything_it_owns_and_is_idempotent(kube):
    mock, cluster = kube
    cluster.apply(spec())
    cluster.apply(spec("other-v1-bb", endpoint="other"))
    cluster.delete("iris-v1-aa")
    mock.emulator.finish_terminating()
    cluster.delete("iris-v1-aa")
    for kind in ("deployments", "services", "poddisruptionbudgets"):
        assert [o["metadata"]["name"] for o in mock.objects(kind, "modelplane")] == [object_name("other-v1-bb")]
    assert {r.revision_id for r in cluster.replicas()} == {"other-v1-bb"}


def test_converge_finishes_a_half_created_revision_and_removes_orphans_without_undoing_a_scale(kube):
    mock, cluster = kube
    cluster.apply(spec())
    cluster.scale("iris-v1-aa", 3)  # the autoscaler's count, which the revisions table does not know
    name = object_name("iris-v1-aa")
    from kubernetes.client import CoreV1Api, PolicyV1Api

    # a crash between the Deployment and its Service, as if: the rest deleted by hand
    CoreV1Api(mock.api_client()).delete_namespaced_service(name, "modelplane")
    PolicyV1Api(mock.api_client()).delete_namespaced_pod_disruption_budget(name, "modelplane")
    cluster.apply(spec("orphan-v1-cc", endpoint="orphan"))  # a revision nothing wants any more

    changed = cluster.converge([spec(replicas=1)])
    assert changed == [f"deleted {object_name('orphan-v1-cc')}", f"finished {name}"]
    assert [o["metadata"]["name"] for o in mock.objects("services", "modelplane")] == [name]
    assert [o["metadata"]["name"] for o in mock.objects("deployments", "modelplane")] == [name]
    [deployment] = mock.objects("deployments", "modelplane")
    assert deployment["spec"]["replicas"] == 3
    assert cluster.converge([spec(replicas=1)]) == []  # nothing left to do


def test_the_watch_survives_broken_streams_and_410_gone_without_losing_a_change(kube):
    mock, cluster = kube
    cluster.apply(spec(replicas=2))
    name = object_name("iris-v1-aa")
    stop = threading.Event()
    watcher = SliceWatcher(cluster._discovery, CONFIG.namespace, cluster.revision_of, watch_timeout_s=30,
                           retry_s=0.05)
    seen: list[list] = []
    thread = threading.Thread(target=lambda: [seen.append(r) for r in watcher.changes(stop.is_set)], daemon=True)
    thread.start()
    ready_count = lambda: (lambda rs: sum(r.ready for r in rs))(seen[-1]) if seen else -1  # noqa: E731
    wait_for(lambda: ready_count() == 0, "the first list")
    first, second = (p["metadata"]["name"] for p in mock.emulator.pods(name))
    mock.emulator.set_ready(first)
    wait_for(lambda: ready_count() == 1, "a watch event")
    mock.break_watches()  # the connection drops; a change lands before the watch is back
    mock.emulator.set_ready(second)
    wait_for(lambda: ready_count() == 2, "the change made while the watch was down")
    relists = watcher.relists
    mock.compact()  # history gone: the next re-watch gets 410 and lists afresh
    mock.break_watches()
    cluster.scale("iris-v1-aa", 1, victims=[first])
    wait_for(lambda: seen[-1] and [r.replica_id for r in seen[-1] if r.ready] == [second], "the scale-down")
    assert watcher.relists > relists
    stop.set()
    mock.bookmark()
    thread.join(10)


def test_a_rollout_never_routes_to_a_replica_that_is_not_ready_even_when_the_watch_breaks(kube, migrated_engine):
    from assets.rollout import rollout
    from assets.served_endpoint import RolloutDriver
    from controlplane.revisions import RevisionStore
    from controlplane.specs import parse_spec
    from controlplane.store import EndpointStore
    from serving.router.table import load_table

    mock, cluster = kube
    store = RevisionStore(migrated_engine)
    EndpointStore(migrated_engine).put(parse_spec("name: iris\nmodel: models:/iris@champion\n"))
    driver = RolloutDriver(cluster, store, log=lambda _m: None, poll_s=0.02, drain_timeout_s=5)
    feed = ReplicaFeed(cluster)
    routed_to_unready: list[str] = []
    routed: set[str] = set()
    done = threading.Event()

    def is_ready(pod: dict) -> bool:
        return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))

    def kubelet():  # readies the starting pods one by one, each after a while; the router's watch breaks twice
        readied = 0
        while not done.wait(0.3):
            starting = [p for p in mock.emulator.pods(terminating=False) if not is_ready(p)]
            if starting:
                mock.emulator.set_ready(starting[0]["metadata"]["name"])
                readied += 1
                if readied == 2:
                    mock.break_watches()  # the connection drops mid-rollout
                if readied == 3:
                    mock.compact()  # and then its resourceVersion is too old to resume from: 410, relist
                    mock.break_watches()

    def router():  # reads the routing table all along, as a router's refresh does
        while not done.wait(0.01):
            ready_or_draining = {p["metadata"]["name"] for p in mock.emulator.pods()
                                 if is_ready(p) or p["metadata"].get("deletionTimestamp")}
            route = load_table(migrated_engine, None, feed.current).endpoints.get("iris")
            pods_by_url = mock.pods_by_url()
            routed.update(route.replicas if route else ())
            routed_to_unready.extend(url for url in (route.replicas if route else ())
                                     if pods_by_url.get(url) not in ready_or_draining)

    workers = [threading.Thread(target=kubelet, daemon=True), threading.Thread(target=router, daemon=True)]
    for worker in workers:
        worker.start()
    try:
        old = store.create("iris", "iris.v1", "/var/lib/modelplane/models/iris/v1", "pyfunc", {}, 2)
        assert driver.run(rollout("iris", old.id, 2)).ok
        new = store.create("iris", "iris.v2", "/var/lib/modelplane/models/iris/v2", "pyfunc", {}, 2)
        assert driver.run(rollout("iris", new.id, 2, expected_previous=old.id)).ok
    finally:
        done.set()
        for worker in workers:
            worker.join(10)
    assert routed_to_unready == []
    assert routed, "the router never had a replica to send to: the check above saw nothing"
    mock.emulator.finish_terminating()
    wait_for(lambda: {r.revision_id for r in feed.current()} == {new.id}, "only the new revision's replicas")
    feed.close()
    assert store.traffic() == {"iris": new.id}
    assert [o["metadata"]["annotations"]["modelplane.io/revision-id"] for o in mock.objects("deployments", "modelplane")] == [new.id]


def test_a_scale_decision_of_the_autoscaler_reaches_the_scale_subresource(kube):
    mock, cluster = kube
    cluster.apply(spec("gec-v1-aa", replicas=1, endpoint="gec"))
    name = object_name("gec-v1-aa")
    mock.emulator.set_all_ready(name)
    plan = EndpointPlan(endpoint="gec", revision_id="gec-v1-aa", runtime="pyfunc", desired_replicas=1, min_replicas=1,
                        max_replicas=8, target_concurrency=4.0, target_pinned=False, sweep_concurrency=(1, 2, 4, 8),
                        slo_p99_ms=1000.0, scale_to_zero_grace_s=300.0, unit_cost_ms=None)
    load = EndpointLoad(in_flight_requests=30.0)

    class Load:
        def read(self):
            return {"gec": load}

    class Stats:
        def read(self, urls, runtime):
            return ReplicaStats()

    class Recorder:
        def record(self, *args, **fields): ...
        def save_demand(self, *args): ...
        def demand(self, *args): return {}

    clock = FakeClock(1000.0)
    decisions: list[int] = []

    def scale(revision_id, replicas, victims=()):
        decisions.append(replicas)
        cluster.scale(revision_id, replicas, victims)

    controller = Controller(plans=lambda: with_desired([plan], cluster),
                            replicas=lambda rid: replica_counts(cluster, rid), load=Load(), stats=Stats(), scale=scale,
                            recorder=Recorder(), is_leader=lambda: True, clock=clock, config=ControllerConfig(),
                            log=lambda _m: None)
    for _ in range(4):  # one decision; the next may come 5 s later
        controller.tick()
        clock.advance(1.0)
    assert decisions == [5]  # ceil(30 / 4) = 8, one step grows 1 by at most +4
    assert requests_to(mock, "PUT", f"/deployments/{name}/scale")
    assert len(mock.emulator.pods(name)) == cluster.desired_replicas("gec-v1-aa") == 5
    for _ in range(30):  # the next step reaches ceil(30 / 4) = 8 and stops there: the count is read back
        controller.tick()
        clock.advance(1.0)
    assert decisions == [5, 8] and len(mock.emulator.pods(name)) == 8


@pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="KUBECONFIG does not point at a real cluster")
def test_against_a_real_cluster():
    from kubernetes import config as kube_config

    namespace = os.environ.get("MODELPLANE_TEST_NAMESPACE", "modelplane-test")
    cluster = KubernetesCluster(kube_config.new_client_from_config(), replace(CONFIG, namespace=namespace))
    revision = spec("contract-v1-aa", replicas=1, endpoint="contract")
    try:
        cluster.apply(revision)
        cluster.apply(revision)
        cluster.scale("contract-v1-aa", 2)
        assert cluster.converge([revision]) == []
    finally:
        cluster.delete("contract-v1-aa")


def test_settings_select_the_kubernetes_backend_its_namespace_and_kubeconfig(kube, tmp_path):
    from controlplane.services import build_services
    from controlplane.settings import Settings
    from cluster.factory import from_settings

    mock, _ = kube
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: mock, cluster: {{server: "{mock.url}"}}}}]
users: [{{name: tester, user: {{}}}}]
contexts: [{{name: mock, context: {{cluster: mock, user: tester}}}}]
current-context: mock
""")
    settings = Settings.from_env({"MODELPLANE_HOME": str(tmp_path), "MODELPLANE_CLUSTER": "kubernetes",
                                  "MODELPLANE_KUBECONFIG": str(kubeconfig), "MODELPLANE_K8S_NAMESPACE": "team-a"})
    cluster = from_settings(settings, engine=None)
    assert isinstance(cluster, KubernetesCluster) and cluster.config.namespace == "team-a"
    cluster.apply(RevisionSpec("iris-v1-aa", "iris", str(tmp_path / "models" / "iris" / "v1"), "pyfunc", 1))
    assert [d["metadata"]["name"] for d in mock.objects("deployments", "team-a")] == [object_name("iris-v1-aa")]
    assert "supervisor" not in [service.name for service in build_services(settings)]  # Kubernetes runs replicas


def test_a_backend_that_cannot_be_reached_or_named_is_refused_with_what_to_do(tmp_path):
    from pydantic import ValidationError

    from cluster.factory import make_cluster
    from controlplane.settings import Settings

    with pytest.raises(ValidationError, match="local|kubernetes"):
        Settings.from_env({"MODELPLANE_HOME": str(tmp_path), "MODELPLANE_CLUSTER": "nomad"})
    with pytest.raises(ValueError, match="is not a file"):
        make_cluster("kubernetes", None, kubeconfig=tmp_path / "missing")
    with pytest.raises(ValueError, match="needs MODELPLANE_KUBECONFIG"):
        make_cluster("kubernetes", None)  # not in a pod: no service account to fall back on
