"""Replicas from EndpointSlices: a pure mapping, and a list-then-watch loop that keeps it current.

The EndpointSlice controller keeps one or more slices per Service (labelled
``kubernetes.io/service-name``, with the Service's own labels copied), each endpoint with its
``ready``, ``serving`` and ``terminating`` conditions. A replica is ready exactly when its
endpoint is ``ready`` (Kubernetes: the readiness probe passes and the pod is not terminating);
a terminating endpoint is never routed to, however it answers.

:class:`SliceWatcher` follows the API's list/watch contract: list, remember the list's
``resourceVersion``, watch from it with ``allowWatchBookmarks`` (a BOOKMARK moves the
resourceVersion without a change), re-watch from the last resourceVersion when a stream ends
or breaks, and list afresh when the server answers 410 Gone (that resourceVersion is no
longer in its history). No event is lost: a re-watch resumes after the last one seen, and a
relist replaces the whole picture.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from kubernetes.client import DiscoveryV1Api
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from cluster.kubernetes.config import MANAGED_BY, REVISION_LABEL
from cluster.protocol import Replica

log = logging.getLogger("modelplane.kubernetes")

SELECTOR = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())


def replicas_from_slices(slices: Iterable[Mapping], revision_of: Callable[[str], str]) -> list[Replica]:
    """One Replica per endpoint (merged across slices; a duplicate keeps its readiest copy), sorted by id.

    >>> s = {"metadata": {"labels": {REVISION_LABEL: "mp-a"}}, "ports": [{"name": "http", "port": 8000}],
    ...      "endpoints": [{"addresses": ["10.0.0.5"], "conditions": {"ready": True},
    ...                     "targetRef": {"kind": "Pod", "name": "mp-a-x1"}},
    ...                    {"addresses": ["10.0.0.6"], "conditions": {"ready": False, "terminating": True},
    ...                     "targetRef": {"kind": "Pod", "name": "mp-a-x2"}}]}
    >>> [(r.replica_id, r.revision_id, r.url, r.ready, r.state) for r in replicas_from_slices([s], lambda n: "a")]
    [('mp-a-x1', 'a', 'http://10.0.0.5:8000', True, 'ready'), ('mp-a-x2', 'a', 'http://10.0.0.6:8000', False, 'terminating')]
    """
    found: dict[str, Replica] = {}
    for piece in slices:
        label = ((piece.get("metadata") or {}).get("labels") or {}).get(REVISION_LABEL)
        ports = piece.get("ports") or []
        port = next((p.get("port") for p in ports if p.get("name") == "http"), ports[0].get("port") if ports else None)
        if label is None or port is None:
            continue
        revision_id = revision_of(label)
        for endpoint in piece.get("endpoints") or []:
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            conditions = endpoint.get("conditions") or {}
            terminating = bool(conditions.get("terminating"))
            ready = conditions.get("ready") is not False and not terminating  # the API: unset ready means ready
            replica_id = (endpoint.get("targetRef") or {}).get("name") or addresses[0]
            host = addresses[0] if ":" not in addresses[0] else f"[{addresses[0]}]"
            state = "terminating" if terminating else "ready" if ready else "starting"
            replica = Replica(replica_id, revision_id, f"http://{host}:{port}", ready, state)
            if replica_id not in found or (ready and not found[replica_id].ready):
                found[replica_id] = replica
    return sorted(found.values(), key=lambda r: r.replica_id)


def list_slices(api: DiscoveryV1Api, namespace: str, selector: str) -> tuple[list[dict], str]:
    """The EndpointSlices the selector picks, as the API's JSON, and the list's resourceVersion."""
    body = json.loads(api.list_namespaced_endpoint_slice(namespace, label_selector=selector,
                                                         _preload_content=False).data)
    return body.get("items") or [], body["metadata"]["resourceVersion"]


class Expired(Exception):
    """410 Gone: the resourceVersion asked for is older than the server's history."""


class SliceWatcher:
    """The current EndpointSlices of modelplane's Services in one namespace, kept by list + watch."""

    def __init__(self, api: DiscoveryV1Api, namespace: str, revision_of: Callable[[str], str],
                 watch_timeout_s: int = 60, retry_s: float = 1.0, sleep: Callable[[float], None] = time.sleep) -> None:
        self._api, self._namespace, self._revision_of = api, namespace, revision_of
        self._watch_timeout_s, self._retry_s, self._sleep = watch_timeout_s, retry_s, sleep
        self.slices: dict[str, dict] = {}
        self.resource_version: str | None = None
        self.relists = 0  # how many times the picture was rebuilt from a list (the first, and one per 410)

    def replicas(self) -> list[Replica]:
        return replicas_from_slices(self.slices.values(), self._revision_of)

    def relist(self) -> None:
        items, self.resource_version = list_slices(self._api, self._namespace, SELECTOR)
        self.slices = {item["metadata"]["name"]: item for item in items}
        self.relists += 1

    def events(self) -> Iterator[dict]:
        """One watch request from ``resource_version``: its change events, applied as they come.
        Raises :class:`Expired` for a 410, whether the server answers the request or the stream with it."""
        try:
            answer = self._api.list_namespaced_endpoint_slice(
                self._namespace, label_selector=SELECTOR, watch=True, resource_version=self.resource_version,
                allow_watch_bookmarks=True, timeout_seconds=self._watch_timeout_s, _preload_content=False)
        except ApiException as exc:
            if exc.status == 410:
                raise Expired(exc.reason) from None
            raise
        try:
            for line in iter_resp_lines(answer):
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Expired(obj.get("message", "resourceVersion too old"))
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                self.resource_version = obj["metadata"]["resourceVersion"]
                if kind == "BOOKMARK":
                    continue
                if kind == "DELETED":
                    self.slices.pop(obj["metadata"]["name"], None)
                else:
                    self.slices[obj["metadata"]["name"]] = obj
                yield event
        finally:
            answer.close()
            answer.release_conn()

    def changes(self, stop: Callable[[], bool] = lambda: False) -> Iterator[list[Replica]]:
        """The replica list now, then after each change; survives broken streams and 410s until ``stop()``."""
        self.relist()
        last = None
        for _ in self._moments(stop):
            current = self.replicas()
            if current != last:
                last = current
                yield current

    def _moments(self, stop: Callable[[], bool]) -> Iterator[None]:
        """Once now, after each event, and after each recovery: when the picture may have changed."""
        yield
        while not stop():
            try:
                for _ in self.events():
                    yield
                    if stop():
                        return
                continue  # the stream ended (timeoutSeconds): watch again from where it stopped
            except Expired as gone:
                log.info("EndpointSlice watch expired (%s): listing afresh", gone)
                self._relist_until_it_works(stop)
            except Exception as exc:  # noqa: BLE001 - a broken connection or a server error: resume from the last resourceVersion
                log.warning("EndpointSlice watch broke (%s: %s); watching again", type(exc).__name__, exc)
                self._sleep(self._retry_s)
            yield

    def _relist_until_it_works(self, stop: Callable[[], bool]) -> None:
        while not stop():
            try:
                self.relist()
                return
            except Exception as exc:  # noqa: BLE001 - the API server may be away for a while
                log.warning("EndpointSlice list failed (%s: %s); retrying", type(exc).__name__, exc)
                self._sleep(self._retry_s)
