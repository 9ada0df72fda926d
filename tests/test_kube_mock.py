"""The Kubernetes API mock (tests/kube_mock) behaves like the API where the backend relies on it.

Everything goes through the real ``kubernetes`` client over HTTP, as the backend's calls will.
"""

from __future__ import annotations

import json
import threading
import time

import kmock
import kubernetes
import pytest
import urllib3
from kubernetes.client.rest import ApiException

from tests.kube_mock import ClusterEmulator, KubeMock, kube_api  # noqa: F401 - kube_api is a fixture

NS = "modelplane"
APPLY = "application/apply-patch+yaml"


def deployment(name: str = "web", replicas: int = 2, image: str = "engine:1", **labels: str) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "labels": {"app": name, **labels}},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name, **labels}},
                                  "spec": {"containers": [{"name": "engine", "image": image}]}}}}


def service(name: str = "web", owner: dict | None = None, **labels: str) -> dict:
    meta: dict = {"name": name, "labels": {"app": name, **labels}}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"selector": {"app": name}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}


def owner_ref(obj) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": obj.metadata.name, "uid": obj.metadata.uid,
            "controller": True, "blockOwnerDeletion": True}


class Clients:
    def __init__(self, kube: KubeMock) -> None:
        client = kube.api_client()
        self.apps = kubernetes.client.AppsV1Api(client)
        self.core = kubernetes.client.CoreV1Api(client)
        self.policy = kubernetes.client.PolicyV1Api(client)
        self.discovery = kubernetes.client.DiscoveryV1Api(client)
        self.rest = client.rest_client

    def apply_deployment(self, body: dict):
        return self.apps.patch_namespaced_deployment(body["metadata"]["name"], NS, body, field_manager="modelplane",
                                                     force=True, _content_type=APPLY)

    def apply_service(self, body: dict):
        return self.core.patch_namespaced_service(body["metadata"]["name"], NS, body, field_manager="modelplane",
                                                  force=True, _content_type=APPLY)

    def slices(self, service_name: str = "web") -> list:
        return self.discovery.list_namespaced_endpoint_slice(
            NS, label_selector=f"kubernetes.io/service-name={service_name}").items


def endpoints(api: Clients, service_name: str = "web") -> dict[str, dict]:
    """pod name -> endpoint conditions, merged over all slices of the service."""
    return {e.target_ref.name: {"ready": e.conditions.ready, "serving": e.conditions.serving,
                                "terminating": e.conditions.terminating}
            for s in api.slices(service_name) for e in s.endpoints or []}


def status_body(exc: ApiException) -> dict:
    return json.loads(exc.body)


def watch_events(func, *args, count: int, timeout: int = 5, **kwargs) -> list[dict]:
    """The first ``count`` events of a watch (fewer if it ends first)."""
    events: list[dict] = []
    stream = kubernetes.watch.Watch().stream(func, *args, timeout_seconds=timeout, **kwargs)
    try:
        for event in stream:
            events.append(event)
            if len(events) >= count:
                break
    finally:
        stream.close()
    return events


# --- writes


def test_apply_creates_then_merges_and_bumps_resource_version(kube_api):
    api = Clients(kube_api)
    created = api.apply_deployment(deployment(tier="a"))
    assert created.metadata.uid and created.metadata.creation_timestamp
    assert created.metadata.generation == 1
    assert created.spec.template.spec.containers[0].termination_message_path == "/dev/termination-log"  # defaulted

    # a field another manager set survives an apply that does not mention it
    api.apps.patch_namespaced_deployment("web", NS, {"metadata": {"annotations": {"note": "kept"}}})
    changed = deployment(replicas=3, tier="b")
    changed["metadata"]["labels"]["extra"] = "yes"
    updated = api.apply_deployment(changed)
    assert int(updated.metadata.resource_version) > int(created.metadata.resource_version)
    assert updated.metadata.labels == {"app": "web", "tier": "b", "extra": "yes"}
    assert updated.metadata.annotations == {"note": "kept"}
    assert updated.spec.replicas == 3 and updated.metadata.generation == 2
    assert updated.metadata.uid == created.metadata.uid

    # the same apply again changes nothing, so it writes nothing
    current = api.apps.read_namespaced_deployment("web", NS)  # the controllers wrote its status meanwhile
    again = api.apply_deployment(changed)
    assert again.metadata.resource_version == current.metadata.resource_version

    # a field this manager applied before and omits now is removed; replicas falls back to its default
    dropped = deployment(tier="b")
    del dropped["spec"]["replicas"]
    after = api.apply_deployment(dropped)
    assert "extra" not in after.metadata.labels and after.spec.replicas == 1
    managers = {(m.manager, m.operation) for m in after.metadata.managed_fields}
    assert ("modelplane", "Apply") in managers


def test_apply_without_field_manager_or_with_a_wrong_content_type_is_refused(kube_api):
    api = Clients(kube_api)
    with pytest.raises(ApiException) as refused:
        api.apps.patch_namespaced_deployment("web", NS, deployment(), _content_type=APPLY)
    assert refused.value.status == 422
    assert "fieldManager" in status_body(refused.value)["message"]
    with pytest.raises(ApiException) as unsupported:
        api.rest.request("PATCH", f"{kube_api.url}/apis/apps/v1/namespaces/{NS}/deployments/web",
                         headers={"Content-Type": "application/foo+json"}, body=deployment())
    assert unsupported.value.status == 415
    assert kube_api.objects("Deployment", NS) == []


def test_apply_of_a_field_another_manager_owns_conflicts_unless_forced(kube_api):
    api = Clients(kube_api)
    api.apply_deployment(deployment(replicas=2))
    api.apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 5}})
    with pytest.raises(ApiException) as conflict:
        api.apps.patch_namespaced_deployment("web", NS, deployment(replicas=2), field_manager="modelplane",
                                             _content_type=APPLY)
    assert conflict.value.status == 409 and ".spec.replicas" in status_body(conflict.value)["message"]
    # without replicas in the manifest, the scaled value stays: the scaler owns it now
    manifest = deployment()
    del manifest["spec"]["replicas"]
    assert api.apply_deployment(manifest).spec.replicas == 5
    assert api.apply_deployment(deployment(replicas=2)).spec.replicas == 2  # force=True takes it back


def test_unknown_names_answer_404_with_a_status(kube_api):
    api = Clients(kube_api)
    calls = [lambda: api.apps.read_namespaced_deployment("nope", NS),
             lambda: api.apps.delete_namespaced_deployment("nope", NS, propagation_policy="Foreground"),
             lambda: api.apps.read_namespaced_deployment_scale("nope", NS),
             lambda: api.core.delete_namespaced_service("nope", NS),
             lambda: api.policy.delete_namespaced_pod_disruption_budget("nope", NS),
             lambda: api.core.delete_namespaced_pod("nope", NS),
             lambda: api.core.patch_namespaced_pod("nope", NS, {"metadata": {"annotations": {"a": "b"}}})]
    for call in calls:
        with pytest.raises(ApiException) as missing:
            call()
        body = status_body(missing.value)
        assert missing.value.status == 404
        assert (body["kind"], body["status"], body["reason"], body["code"]) == ("Status", "Failure", "NotFound", 404)
        assert body["details"]["name"] == "nope" and "not found" in body["message"]


def test_stale_resource_version_on_replace_is_a_409_conflict(kube_api):
    api = Clients(kube_api)
    api.apply_deployment(deployment())
    scale = api.apps.read_namespaced_deployment_scale("web", NS)
    stale_deployment = api.apps.read_namespaced_deployment("web", NS)
    api.apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 3}})

    scale.spec.replicas = 7
    with pytest.raises(ApiException) as conflict:
        api.apps.replace_namespaced_deployment_scale("web", NS, scale)
    body = status_body(conflict.value)
    assert conflict.value.status == 409 and (body["reason"], body["code"]) == ("Conflict", 409)
    stale_deployment.metadata.labels["x"] = "y"
    with pytest.raises(ApiException) as conflict:
        api.apps.replace_namespaced_deployment("web", NS, stale_deployment)
    assert conflict.value.status == 409 and status_body(conflict.value)["reason"] == "Conflict"
    assert api.apps.read_namespaced_deployment("web", NS).spec.replicas == 3  # neither write landed

    fresh = api.apps.read_namespaced_deployment_scale("web", NS)
    fresh.spec.replicas = 4
    assert api.apps.replace_namespaced_deployment_scale("web", NS, fresh).spec.replicas == 4


def test_scale_goes_through_the_subresource_and_changes_the_pods(kube_api):
    api = Clients(kube_api)
    before = api.apply_deployment(deployment(replicas=1))
    assert len(api.core.list_namespaced_pod(NS, label_selector="app=web").items) == 1

    scale = api.apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 4}})
    assert scale.kind == "Scale" and scale.api_version == "autoscaling/v1"
    assert scale.spec.replicas == 4 and scale.status.selector == "app=web"
    after = api.apps.read_namespaced_deployment("web", NS)
    assert after.spec.replicas == 4 and int(after.metadata.resource_version) > int(before.metadata.resource_version)
    assert len(api.core.list_namespaced_pod(NS, label_selector="app=web").items) == 4
    assert ("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/web/scale", {}) in kube_api.requests
    assert api.apps.read_namespaced_deployment_scale("web", NS).status.replicas == 4

    api.apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 1}})
    pods = api.core.list_namespaced_pod(NS, label_selector="app=web").items
    assert sorted(p.metadata.deletion_timestamp is not None for p in pods) == [False, True, True, True]
    assert len(kube_api.emulator.finish_terminating()) == 3
    assert len(api.core.list_namespaced_pod(NS, label_selector="app=web").items) == 1


def test_pods_accept_merge_strategic_and_json_patches(kube_api):
    api = Clients(kube_api)
    api.apply_deployment(deployment(replicas=1))
    pod = api.core.list_namespaced_pod(NS).items[0].metadata.name
    patched = api.core.patch_namespaced_pod(pod, NS, {"metadata": {"annotations": {"a": "1"}}})  # strategic merge
    assert patched.metadata.annotations == {"a": "1"}
    patched = api.core.patch_namespaced_pod(pod, NS, {"metadata": {"annotations": {"b": "2"}}},
                                            _content_type="application/merge-patch+json")
    assert patched.metadata.annotations == {"a": "1", "b": "2"}
    patched = api.core.patch_namespaced_pod(pod, NS, [{"op": "remove", "path": "/metadata/annotations/a"}])
    assert patched.metadata.annotations == {"b": "2"}
    with pytest.raises(ApiException) as stale:
        api.core.patch_namespaced_pod(pod, NS, {"metadata": {"resourceVersion": "1", "labels": {"x": "y"}}})
    assert stale.value.status == 409


def test_deleting_a_deployment_collects_what_it_owns(kube_api):
    api = Clients(kube_api)
    owner = api.apply_deployment(deployment(replicas=2))
    api.apply_service(service(owner=owner_ref(owner)))
    api.policy.patch_namespaced_pod_disruption_budget(
        "web", NS, {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                    "metadata": {"name": "web", "ownerReferences": [owner_ref(owner)]},
                    "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "web"}}}},
        field_manager="modelplane", force=True, _content_type=APPLY)
    api.apply_service(service("other"))
    assert len(api.slices()) == 1

    api.apps.delete_namespaced_deployment("web", NS, propagation_policy="Background")
    assert [s.metadata.name for s in api.core.list_namespaced_service(NS).items] == ["other"]
    assert api.policy.list_namespaced_pod_disruption_budget(NS).items == []
    assert api.slices() == []  # owned by the Service, collected with it
    pods = api.core.list_namespaced_pod(NS).items
    assert len(pods) == 2 and all(p.metadata.deletion_timestamp for p in pods)  # graceful termination
    kube_api.emulator.finish_terminating()
    assert api.core.list_namespaced_pod(NS).items == []


def test_foreground_deletion_waits_for_the_pods(kube_api):
    api = Clients(kube_api)
    api.apply_deployment(deployment(replicas=2))
    api.apps.delete_namespaced_deployment("web", NS, propagation_policy="Foreground")
    lingering = api.apps.read_namespaced_deployment("web", NS)
    assert lingering.metadata.deletion_timestamp and lingering.metadata.finalizers == ["foregroundDeletion"]
    assert all(p.metadata.deletion_timestamp for p in api.core.list_namespaced_pod(NS).items)
    kube_api.emulator.finish_terminating()
    assert api.apps.list_namespaced_deployment(NS).items == []
    assert api.core.list_namespaced_pod(NS).items == []


def test_label_selectors(kube_api):
    api = Clients(kube_api)
    for name, labels in [("a", {"tier": "gpu", "rev": "1"}), ("b", {"tier": "cpu", "rev": "1"}),
                         ("c", {"tier": "gpu", "rev": "2", "canary": "yes"})]:
        api.apply_deployment(deployment(name, replicas=0, **labels))

    def names(selector: str) -> list[str]:
        return [d.metadata.name for d in api.apps.list_namespaced_deployment(NS, label_selector=selector).items]

    assert names("tier=gpu,rev=1") == ["a"]
    assert names("tier==gpu") == ["a", "c"]
    assert names("tier!=gpu") == ["b"]
    assert names("canary") == ["c"]
    assert names("!canary") == ["a", "b"]
    assert names("rev in (1, 2),tier notin (cpu)") == ["a", "c"]
    assert names("rev in (2, 9)") == ["c"]
    assert names("app=b") == ["b"]
    with pytest.raises(ApiException) as malformed:
        names("tier in gpu")
    assert malformed.value.status == 400


# --- watches


def test_watch_delivers_the_changes_after_a_resource_version_in_order(kube_api):
    api = Clients(kube_api)
    api.apply_deployment(deployment(replicas=1))
    listed = api.discovery.list_namespaced_endpoint_slice(NS, label_selector="kubernetes.io/service-name=web")
    assert listed.items == [] and listed.metadata.resource_version
    api.apply_service(service())
    pod = kube_api.emulator.pods("web")[0]["metadata"]["name"]
    kube_api.emulator.set_ready(pod)
    api.core.delete_namespaced_service("web", NS)
    api.apply_service(service("unrelated"))

    events = watch_events(api.discovery.list_namespaced_endpoint_slice, NS, count=3, timeout=2,
                          label_selector="kubernetes.io/service-name=web",
                          resource_version=listed.metadata.resource_version)
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]
    versions = [int(e["object"].metadata.resource_version) for e in events]
    assert versions == sorted(versions) and versions[0] > int(listed.metadata.resource_version)
    assert events[0]["object"].endpoints[0].conditions.ready is False
    assert events[1]["object"].endpoints[0].conditions.ready is True
    assert events[0]["object"].metadata.labels["endpointslice.kubernetes.io/managed-by"] == \
        "endpointslice-controller.k8s.io"


def test_watch_with_a_selector_sees_objects_move_in_and_out_as_added_and_deleted(kube_api):
    api = Clients(kube_api)
    api.apply_deployment(deployment(replicas=1))
    pod = kube_api.emulator.pods("web")[0]["metadata"]["name"]
    since = kube_api.resource_version
    api.core.patch_namespaced_pod(pod, NS, {"metadata": {"labels": {"drain": "yes"}}})
    api.core.patch_namespaced_pod(pod, NS, {"metadata": {"annotations": {"seen": "1"}}})
    api.core.patch_namespaced_pod(pod, NS, {"metadata": {"labels": {"drain": None}}})
    events = watch_events(api.core.list_namespaced_pod, NS, count=3, timeout=1, label_selector="drain=yes",
                          resource_version=since)
    assert [(e["type"], e["object"].metadata.name) for e in events] == [
        ("ADDED", pod), ("MODIFIED", pod), ("DELETED", pod)]
    assert "drain" not in events[-1]["object"].metadata.labels  # the state that left the selection


def test_bookmarks_arrive_only_when_allowed():
    with KubeMock(bookmark_interval=0.2) as kube:
        api = Clients(kube)
        api.apply_service(service())
        events = watch_events(api.discovery.list_namespaced_endpoint_slice, NS, count=3, timeout=3,
                              resource_version=kube.resource_version, allow_watch_bookmarks=True)
        assert [e["type"] for e in events] == ["BOOKMARK"] * 3
        assert events[-1]["raw_object"] == {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                            "metadata": {"resourceVersion": kube.resource_version}}
        assert watch_events(api.discovery.list_namespaced_endpoint_slice, NS, count=1, timeout=1,
                            resource_version=kube.resource_version) == []


def test_bookmark_on_demand_carries_the_latest_revision():
    with KubeMock(bookmark_interval=60) as kube:
        api = Clients(kube)
        got: list[dict] = []
        reader = threading.Thread(target=lambda: got.extend(watch_events(
            api.discovery.list_namespaced_endpoint_slice, NS, count=1, timeout=5,
            resource_version=kube.resource_version, allow_watch_bookmarks=True)))
        reader.start()
        deadline = time.monotonic() + 5
        while kube.open_watches == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        api.apply_deployment(deployment(replicas=0))  # not a slice: only moves the revision
        kube.bookmark()
        reader.join(5)
        assert [e["type"] for e in got] == ["BOOKMARK"]
        assert got[0]["raw_object"]["metadata"]["resourceVersion"] == kube.resource_version


def test_a_compacted_resource_version_gets_a_410_error_event(kube_api):
    api = Clients(kube_api)
    old = kube_api.resource_version
    api.apply_service(service())
    kube_api.compact()

    raw = api.discovery.list_namespaced_endpoint_slice(NS, watch=True, resource_version=old, timeout_seconds=5,
                                                       _preload_content=False)
    lines = [json.loads(line) for line in raw.data.decode().splitlines()]  # the stream ends after the event
    assert lines == [{"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Expired",
        "code": 410, "message": f"too old resource version: {old} ({kube_api.resource_version})"}}]

    with pytest.raises(ApiException) as expired:  # how the python client's Watch surfaces it
        watch_events(api.discovery.list_namespaced_endpoint_slice, NS, count=1, resource_version=old)
    assert expired.value.status == 410 and expired.value.reason.startswith("Expired: too old resource version")
    current = watch_events(api.discovery.list_namespaced_endpoint_slice, NS, count=1, timeout=1,
                           resource_version=kube_api.resource_version)
    assert current == []  # from the current revision on, it is fine


def test_break_watches_drops_the_connections(kube_api):
    api = Clients(kube_api)
    api.apply_service(service())
    outcome: list = []

    def consume() -> None:
        try:
            for event in kubernetes.watch.Watch().stream(api.discovery.list_namespaced_endpoint_slice, NS,
                                                         timeout_seconds=30):
                outcome.append(event["type"])
        except Exception as exc:  # noqa: BLE001 - what the client raises is the point
            outcome.append(exc)

    reader = threading.Thread(target=consume)
    reader.start()
    deadline = time.monotonic() + 5
    while (kube_api.open_watches == 0 or not outcome) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kube_api.break_watches() == 1
    reader.join(5)
    assert not reader.is_alive()
    assert outcome[0] == "ADDED" and isinstance(outcome[-1], urllib3.exceptions.ProtocolError)
    assert kube_api.open_watches == 0


def test_end_watches_ends_the_streams_cleanly(kube_api):
    api = Clients(kube_api)
    outcome: list = []

    def consume() -> None:
        try:
            outcome.extend(e["type"] for e in kubernetes.watch.Watch().stream(
                api.discovery.list_namespaced_endpoint_slice, NS, timeout_seconds=30))
            outcome.append("ended")
        except Exception as exc:  # noqa: BLE001
            outcome.append(exc)

    reader = threading.Thread(target=consume)
    reader.start()
    deadline = time.monotonic() + 5
    while kube_api.open_watches == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kube_api.end_watches() == 1
    reader.join(5)
    assert outcome == ["ended"]


def test_timeout_seconds_ends_the_stream(kube_api):
    api = Clients(kube_api)
    started = time.monotonic()
    assert watch_events(api.discovery.list_namespaced_endpoint_slice, NS, count=1, timeout=1,
                        resource_version=kube_api.resource_version) == []
    assert 0.9 < time.monotonic() - started < 5


# --- the emulated controllers


def test_endpoint_slices_follow_readiness_and_termination(kube_api):
    api = Clients(kube_api)
    api.apply_deployment(deployment(replicas=2))
    api.apply_service(service(team="serving"))
    (only,) = api.slices()
    assert only.metadata.labels == {"app": "web", "team": "serving", "kubernetes.io/service-name": "web",
                                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}
    assert only.address_type == "IPv4" and [(p.name, p.port, p.protocol) for p in only.ports] == [("http", 8080, "TCP")]
    assert only.metadata.owner_references[0].kind == "Service"
    first, second = (p["metadata"]["name"] for p in kube_api.emulator.pods("web"))
    not_ready = {"ready": False, "serving": False, "terminating": False}
    assert endpoints(api) == {first: not_ready, second: not_ready}

    kube_api.emulator.set_all_ready("web")
    kube_api.emulator.set_ready(first, False)
    assert endpoints(api) == {first: not_ready, second: {"ready": True, "serving": True, "terminating": False}}
    target = api.slices()[0].endpoints[0].target_ref
    assert (target.kind, target.namespace) == ("Pod", NS) and target.uid

    kube_api.emulator.set_ready(first, True)
    api.apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 1}})
    victim = second  # both ready, same cost: the newest goes
    assert endpoints(api)[victim] == {"ready": False, "serving": True, "terminating": True}
    kube_api.emulator.set_ready(victim, False)
    assert endpoints(api)[victim] == {"ready": False, "serving": False, "terminating": True}
    kube_api.emulator.finish_terminating()
    assert list(endpoints(api)) == [first]


def test_scale_down_picks_victims_like_the_replicaset_controller(kube_api):
    api = Clients(kube_api)
    api.apply_deployment(deployment(replicas=4))
    a, b, c, d = (p["metadata"]["name"] for p in kube_api.emulator.pods("web"))
    kube_api.emulator.set_all_ready("web")
    kube_api.emulator.set_ready(c, False)
    for pod, cost in [(a, "-100"), (b, "100"), (d, "0")]:
        api.core.patch_namespaced_pod(pod, NS, {"metadata": {"annotations": {
            "controller.kubernetes.io/pod-deletion-cost": cost}}})

    def terminating() -> list[str]:
        return [p["metadata"]["name"] for p in kube_api.emulator.pods("web", terminating=True)]

    api.apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 3}})
    assert terminating() == [c]  # not ready goes first
    api.apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 2}})
    assert terminating() == [a, c]  # then the lowest deletion cost
    api.apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 1}})
    assert terminating() == [a, c, d]  # cost 0 before cost 100
    kube_api.emulator.finish_terminating()
    assert [p["metadata"]["name"] for p in kube_api.emulator.pods("web")] == [b]


def test_scale_down_among_equals_takes_the_newest(kube_api):
    api = Clients(kube_api)
    api.apply_deployment(deployment(replicas=3))
    names = [p["metadata"]["name"] for p in kube_api.emulator.pods("web")]
    kube_api.emulator.set_all_ready("web")
    api.apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 1}})
    assert [p["metadata"]["name"] for p in kube_api.emulator.pods("web", terminating=True)] == names[1:]


def test_pods_with_their_own_ports_get_their_own_slices():
    ports = iter(range(41001, 41100))
    with KubeMock(ClusterEmulator(pod_address=lambda pod: ("127.0.0.1", next(ports)))) as kube:
        api = Clients(kube)
        api.apply_deployment(deployment(replicas=3))
        api.apply_service(service())
        slices = api.slices()
        assert sorted((s.endpoints[0].addresses[0], s.ports[0].port) for s in slices) == [
            ("127.0.0.1", 41001), ("127.0.0.1", 41002), ("127.0.0.1", 41003)]
        assert all(len(s.endpoints) == 1 for s in slices)
        api.apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 0}})
        kube.emulator.finish_terminating()
        (placeholder,) = api.slices()
        assert placeholder.endpoints == [] and placeholder.ports == []


def test_pods_can_terminate_at_once():
    with KubeMock(ClusterEmulator(terminate_immediately=True)) as kube:
        api = Clients(kube)
        api.apply_deployment(deployment(replicas=3))
        api.apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 1}})
        assert len(api.core.list_namespaced_pod(NS).items) == 1


def test_a_template_change_replaces_the_pods_and_status_tracks_the_rollout(kube_api):
    api = Clients(kube_api)
    api.apply_deployment(deployment(replicas=2))
    old = {p["metadata"]["name"] for p in kube_api.emulator.pods("web")}
    kube_api.emulator.set_all_ready("web")
    status = api.apps.read_namespaced_deployment_status("web", NS).status
    assert (status.replicas, status.ready_replicas, status.updated_replicas) == (2, 2, 2)

    rolled = api.apply_deployment(deployment(replicas=2, image="engine:2"))
    assert rolled.metadata.generation == 2
    live = {p["metadata"]["name"] for p in kube_api.emulator.pods("web", terminating=False)}
    assert len(live) == 2 and not live & old
    status = api.apps.read_namespaced_deployment("web", NS).status
    assert status.observed_generation == 2 and status.ready_replicas is None  # zero counts are omitted
    kube_api.emulator.set_all_ready("web")
    status = api.apps.read_namespaced_deployment("web", NS).status
    assert status.ready_replicas == 2 and status.updated_replicas == 2


def test_a_bearer_token_is_checked():
    with KubeMock(token="secret") as kube:
        assert kubernetes.client.AppsV1Api(kube.api_client()).list_namespaced_deployment(NS).items == []
        anonymous = kubernetes.client.Configuration()
        anonymous.host = kube.url
        client = kubernetes.client.ApiClient(anonymous)
        try:
            with pytest.raises(ApiException) as refused:
                kubernetes.client.AppsV1Api(client).list_namespaced_deployment(NS)
        finally:
            client.close()
        assert refused.value.status == 401


def test_kmock_reactions_inject_faults_in_front_of_the_emulation(kube_api):
    api = Clients(kube_api)
    api.apply_deployment(deployment(replicas=1))
    kube_api.handler["patch", kmock.subresource("scale")][:1] << 503
    with pytest.raises(ApiException) as failed:
        api.apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 2}})
    assert failed.value.status == 503
    assert api.apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 2}}).spec.replicas == 2


def test_the_server_leaves_no_thread_behind():
    before = set(threading.enumerate())
    with KubeMock() as kube:
        api = Clients(kube)
        api.apply_service(service())
        reader = threading.Thread(target=lambda: watch_events(api.discovery.list_namespaced_endpoint_slice, NS,
                                                              count=99, timeout=30))
        reader.start()
        deadline = time.monotonic() + 5
        while kube.open_watches == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    reader.join(5)  # the open watch ended when the server stopped
    assert not reader.is_alive()
    assert set(threading.enumerate()) <= before


def test_an_internal_error_answers_500_and_fails_the_test_at_exit():
    def broken(pod: dict) -> tuple[str, int]:
        raise RuntimeError("pod_address is broken")

    with pytest.raises(AssertionError, match="pod_address is broken"):
        with KubeMock(ClusterEmulator(pod_address=broken)) as kube:
            with pytest.raises(ApiException) as failed:
                Clients(kube).apply_deployment(deployment(replicas=1))
            assert failed.value.status == 500 and status_body(failed.value)["reason"] == "InternalError"
