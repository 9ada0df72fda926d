"""A Kubernetes API mock server for the Kubernetes backend's tests, built on kmock.

``KubeMock`` serves Deployments (with the scale and status subresources), Services, Pods,
PodDisruptionBudgets and EndpointSlices over HTTP on 127.0.0.1, for the real ``kubernetes``
client, with the semantics the backend relies on; ``ClusterEmulator`` plays the controllers
and the kubelet behind it. Use the ``kube_api`` fixture, or::

    with KubeMock(ClusterEmulator(pod_address=...)) as kube:
        apps = kubernetes.client.AppsV1Api(kube.api_client())

What kmock 0.8 provides and is used as is: the HTTP server (``kmock.Server``: aiohttp on a
free port), request parsing into resource/namespace/name/subresource and the request log
(``KubeMock.requests``, and kmock's filtering DSL on ``KubeMock.handler``), Kubernetes error
rendering as a v1 Status (``kmock.KubernetesError``), API discovery
(``kmock.KubernetesScaffold``), JSON-lines streaming of a reaction's async generator (the
watch responses), JSON merge patch and JSON patch (``kmock.Object.patch``), and the
reaction DSL, which stays usable for fault injection: reactions a test adds to
``KubeMock.handler`` take precedence over the emulation, e.g.
``kube.handler['patch', kmock.subresource('scale')][:1] << 500`` fails the next scale.

What is added, and why kmock's own stateful ``KubernetesEmulator`` is not used: its store
applies every PATCH as a merge to the addressed object before any reaction sees it (so a
PATCH to ``/scale`` or a JSON-patch list would be applied to the Deployment itself), it
has no resourceVersion (no 409 on a stale write, no list revision, no watch from a
revision, no 410, no bookmarks, no timeoutSeconds), no PUT, no label selectors, no
server-side apply, no subresources, no garbage collection, and it recognises watches only
by ``watch=true`` while the python client sends ``watch=True``. So this package builds on
``kmock.KubernetesScaffold`` and adds, in ``store.py``, ``api.py``, ``schema.py``, ``server.py``:

- one global revision (etcd's), as strings, on objects and lists; a change log; ``compact()``;
- verbs with real semantics: create, get, list (items without apiVersion/kind, as the API
  sends them; label selectors with ``=``, ``==``, ``!=``, exists, ``!key``, ``in``,
  ``notin``; fieldSelector on name/namespace), replace (409 on a stale resourceVersion),
  patch (merge, strategic-merge as merge, JSON patch; a resourceVersion in the patch is a
  precondition), server-side apply (fieldManager required: 422 otherwise; create-or-merge;
  managedFields ownership, see ``api.py``),
  delete (404 Status for unknown names; Foreground/Background/Orphan; graceful pod
  deletion; finalizers), deletecollection; status and scale subresources (autoscaling/v1
  Scale, 409 on a stale resourceVersion); defaulting and validation a real cluster applies;
- watches: ADDED/MODIFIED/DELETED from a resourceVersion in order (objects moving into or
  out of a label selector arrive as ADDED/DELETED), BOOKMARKs with ``allowWatchBookmarks``
  every ``bookmark_interval`` and on ``bookmark()``, the 410 ``Expired`` ERROR event and end
  of stream when the revision is older than the history, ``timeoutSeconds``, and
  ``break_watches()`` (connections dropped) and ``end_watches()`` (streams ended);
- ``ClusterEmulator`` (``emulator.py``): the Deployment controller, EndpointSlice
  controller, garbage collector, scheduler and kubelet, run synchronously on changes.

kmock 0.8 quirks met on the way (worked around or out of scope): a reaction's
``kmock.Response`` status sticks to the reaction (so every answer here sets its status
explicitly); ``/api/v1/namespaces`` crashes kmock's path parser (500, reported at exit) and
``/api/v1/namespaces/<name>`` parses without a resource, so Namespaces are not served;
``kmock.Server`` patches aiohttp's ``TCPConnector._resolve_host`` process-wide while it runs
(it only maps 127.0.0.1:<its port> to itself, but nested KubeMocks must exit in LIFO order).

Not emulated: namespaces (any namespace works), dryRun (refused with 400), list paging
(``limit`` is ignored, everything comes in one page), ReplicaSets, PDB status, field
ownership inside associative lists.

How the python client's ``kubernetes.watch.Watch().stream`` surfaces the 410 ERROR event
(kubernetes 36.0.3, ``watch/watch.py``): it never yields it. With ``timeout_seconds`` given
(retries disabled) it raises ``ApiException(status=410, reason="Expired: too old resource
version: …")`` at once; without it, it silently re-issues the watch once from the same
resourceVersion and raises that ApiException when the second attempt also gets 410. With
``deserialize=False`` it fails with ``KeyError('raw_object')`` instead (a client bug). A
dropped connection (``break_watches()``) surfaces as ``urllib3.exceptions.ProtocolError``;
a stream ended by the server (``timeoutSeconds``, ``end_watches()``) just ends the
generator when ``timeout_seconds`` was given, and is silently re-opened from the last seen
resourceVersion (if it has one) when it was not.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kube_mock.emulator import ClusterEmulator
from tests.kube_mock.server import KubeMock

__all__ = ["ClusterEmulator", "KubeMock", "kube_api"]


@pytest.fixture
def kube_api() -> Iterator[KubeMock]:
    """A running ``KubeMock`` with the default ``ClusterEmulator``."""
    with KubeMock() as kube:
        yield kube
