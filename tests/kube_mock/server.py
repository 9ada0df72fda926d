"""The HTTP side: a kmock handler that routes the resources' URLs to the API verbs and streams
watches, and ``KubeMock``, which serves it on 127.0.0.1 from a background thread.

kmock parses every request into resource/namespace/name/subresource, records it, renders
``kmock.KubernetesError`` as a v1 Status and streams what a reaction yields as JSON lines;
this module adds one low-priority (``fallback``) reaction per served resource, so a test can
still put its own reactions in front for fault injection (``mock.handler[...] << 500``).
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import attrs
import kmock
import kubernetes

from tests.kube_mock.api import Api, default_manager
from tests.kube_mock.store import (KINDS, Event, Expired, Kind, Store, api_error, bad_request, field_selector_matches,
                                   kind_of, parse_field_selector, parse_selector, selector_matches)


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("true", "1")  # the python client sends "True"


def _header(request: kmock.Request, name: str) -> str:
    return next((value for key, value in request.headers.items() if key.lower() == name.lower()), "")


class _Watch:
    """One open watch connection: a queue the store pushes into (from any thread) and a wake-up."""

    def __init__(self, loop: asyncio.AbstractEventLoop, raw_request: aiohttp.web.BaseRequest | None) -> None:
        self.loop = loop
        self.raw_request = raw_request
        self.queue: collections.deque[Event] = collections.deque()
        self.wake = asyncio.Event()
        self.closed = False
        self.bookmark_requested = False

    def push(self, event: Event) -> None:  # called under the store lock, in revision order
        self.queue.append(event)
        self.poke()

    def poke(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.wake.set)
        except RuntimeError:  # the loop is closed: the watch is gone anyway
            pass

    def end(self, abruptly: bool) -> None:
        """End the stream: gracefully (the response ends) or abruptly (the connection is dropped)."""
        self.closed = True

        def close() -> None:
            transport = self.raw_request.transport if self.raw_request is not None else None
            if abruptly and transport is not None:
                transport.abort()
            self.wake.set()
        try:
            self.loop.call_soon_threadsafe(close)
        except RuntimeError:
            pass


@attrs.define(kw_only=True)
class KubeApiHandler(kmock.KubernetesScaffold):
    """kmock's Kubernetes scaffold (errors, discovery, request log) serving ``Api`` for ``KINDS``."""

    api: Api
    after_write: Callable[[], None] = lambda: None
    token: str | None = None
    bookmark_interval: float = 1.0
    watches: set[_Watch] = attrs.field(factory=set, init=False)
    internal_errors: list[str] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for kind in KINDS.values():
            resource = kmock.resource(kind.group, kind.version, kind.plural)
            self.resources[resource] = kmock.ResourceInfo(
                kind=kind.kind, namespaced=True,
                verbs={"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"},
                subresources=({"status"} if kind.status_subresource else set())
                | ({"scale"} if kind.plural == "deployments" else set()))
            self.fallback[resource] << self._serve

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, kmock.KubernetesError):
            status: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                      "message": exc.message, "reason": exc.reason, "code": exc.status}
            if exc.details:
                status["details"] = exc.details
            return aiohttp.web.json_response(status, status=exc.status)
        self.internal_errors.append("".join(traceback.format_exception(exc)))
        return aiohttp.web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                          "message": f"kube_mock internal error: {exc!r}", "reason": "InternalError",
                                          "code": 500}, status=500)

    async def _serve(self, request: kmock.Request) -> kmock.Response:
        # Always an explicit status: kmock keeps the status of a reaction's last kmock.Response
        # on the reaction itself (it mutates the shared Response), so a 201 would stick.
        payload, status = self._route(request)
        return kmock.Response(status=status, payload=payload)

    def _route(self, request: kmock.Request) -> tuple[Any, int]:
        if self.token is not None and _header(request, "Authorization") != f"Bearer {self.token}":
            raise api_error(401, "Unauthorized", "Unauthorized")
        kind = KINDS[request.resource.plural]
        ns, name, sub = request.namespace, request.name, request.subresource
        method, params = request.method.value.upper(), request.params
        manager = params.get("fieldManager") or default_manager(_header(request, "User-Agent"))
        if sub not in (None, "status", "scale") or (sub == "scale" and kind.plural != "deployments") \
                or (sub == "status" and not kind.status_subresource):
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        if method != "GET" and params.get("dryRun"):
            raise bad_request("kube_mock does not emulate dryRun")
        if method == "GET" and _truthy(params.get("watch")):
            field_selector = params.get("fieldSelector")
            if name is not None:  # the old style of watching one object
                field_selector = ",".join(filter(None, [field_selector, f"metadata.name={name}"]))
            return self._watch(request, kind, ns, params, field_selector), 200
        if name is None:
            if method == "GET":
                return self.api.list(kind, ns, params.get("labelSelector"), params.get("fieldSelector")), 200
            if ns is None:
                raise api_error(405, "MethodNotAllowed", f"the server does not allow this method on {kind.qualified}")
            if method == "POST":
                created = self.api.create(kind, ns, self._json(request), manager=manager)
                self.after_write()
                return created, 201
            if method == "DELETE":
                listed = self.api.list(kind, ns, params.get("labelSelector"), params.get("fieldSelector"))
                for item in listed["items"]:
                    self.api.delete(kind, ns, item["metadata"]["name"], **self._delete_options(request))
                self.after_write()
                return listed, 200
            raise api_error(405, "MethodNotAllowed", f"the server does not allow this method on {kind.qualified}")
        if ns is None:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        if method == "GET":
            return self.api.read_scale(kind, ns, name) if sub == "scale" else self.api.read(kind, ns, name), 200
        if method == "PUT":
            body = self._json(request)
            if sub == "scale":
                result = self.api.replace_scale(kind, ns, name, body, manager=manager)
            else:
                result = self.api.replace(kind, ns, name, body, manager=manager, subresource=sub)
            self.after_write()
            return result, 200
        if method == "PATCH":
            result, created = self.api.patch(kind, ns, name, request.body, _header(request, "Content-Type"),
                                             manager=params.get("fieldManager"), force=_truthy(params.get("force")),
                                             user_agent=_header(request, "User-Agent"), subresource=sub)
            self.after_write()
            return result, 201 if created else 200
        if method == "DELETE" and sub is None:
            result = self.api.delete(kind, ns, name, **self._delete_options(request))
            self.after_write()
            return result, 200 if result.get("kind") == "Status" else 202  # 202: the object lingers
        raise api_error(405, "MethodNotAllowed", f"the server does not allow this method on {kind.qualified}")

    @staticmethod
    def _json(request: kmock.Request) -> Any:
        try:
            return json.loads(request.body or b"null")
        except ValueError as exc:
            raise bad_request(f"the body of the request could not be decoded: {exc}") from None

    @staticmethod
    def _delete_options(request: kmock.Request) -> dict[str, Any]:
        try:
            options = json.loads(request.body) if request.body else {}
        except ValueError:
            raise bad_request("the body of the request could not be decoded as DeleteOptions") from None
        options = options or {}
        grace = request.params.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
        return {"propagation": request.params.get("propagationPolicy", options.get("propagationPolicy")),
                "grace": int(grace) if grace is not None else None}

    # --- watches

    def _watch(self, request: kmock.Request, kind: Kind, ns: str | None, params: dict[str, str],
               field_selector: str | None) -> AsyncIterator[Any]:
        try:
            labels, fields = parse_selector(params.get("labelSelector")), parse_field_selector(field_selector)
            since = params.get("resourceVersion") or None
            since_rv = None if since in (None, "0") else int(since)
            timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        bookmarks = _truthy(params.get("allowWatchBookmarks"))
        store = self.api.store
        watch = _Watch(asyncio.get_running_loop(), getattr(request, "_raw_request", None))

        def visible(obj: dict | None) -> bool:
            return (obj is not None and ns in (None, obj["metadata"].get("namespace"))
                    and selector_matches(labels, obj["metadata"].get("labels"))
                    and field_selector_matches(fields, obj))

        def render(event: Event) -> dict | None:
            if event.kind is not kind or (since_rv is not None and event.rv <= since_rv):
                return None
            before, after = visible(event.old), visible(event.new)
            if event.type == "MODIFIED" and before != after:  # moved into/out of the selection
                return {"type": "ADDED" if after else "DELETED", "object": event.new}
            return {"type": event.type, "object": event.new} if after else None

        async def stream() -> AsyncIterator[Any]:
            yield b""  # the response headers go out now, before any event
            try:
                backlog = store.subscribe(watch.push, since_rv)
            except Expired as exc:
                yield {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                                   "status": "Failure", "message": str(exc), "reason": "Expired",
                                                   "code": 410}}
                return
            self.watches.add(watch)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout if timeout is not None else None
            next_bookmark = loop.time() + self.bookmark_interval
            pending = collections.deque(backlog)
            try:
                while True:
                    watch.wake.clear()
                    with store.lock:  # drained together with the revision: a bookmark never skips an event
                        pending.extend(watch.queue)
                        watch.queue.clear()
                        revision = store.rv
                    while pending and not watch.closed:
                        if (event := render(pending.popleft())) is not None:
                            yield event
                    if watch.closed or (deadline is not None and loop.time() >= deadline):
                        return
                    transport = watch.raw_request.transport if watch.raw_request is not None else None
                    if watch.raw_request is not None and (transport is None or transport.is_closing()):
                        return  # the client went away
                    if bookmarks and (watch.bookmark_requested or loop.time() >= next_bookmark):
                        yield {"type": "BOOKMARK", "object": {"kind": kind.kind, "apiVersion": kind.api_version,
                                                              "metadata": {"resourceVersion": str(revision)}}}
                    if watch.bookmark_requested or loop.time() >= next_bookmark:
                        watch.bookmark_requested = False
                        next_bookmark = loop.time() + self.bookmark_interval
                    wait = next_bookmark - loop.time()
                    if deadline is not None:
                        wait = min(wait, deadline - loop.time())
                    try:
                        await asyncio.wait_for(watch.wake.wait(), max(wait, 0))
                    except TimeoutError:
                        pass
            finally:
                store.unsubscribe(watch.push)
                self.watches.discard(watch)

        return stream()


class KubeMock:
    """A Kubernetes API mock on 127.0.0.1 with an emulated control plane; a context manager.

    ``with KubeMock() as kube:`` starts it on a free port in a background thread; on exit it
    ends the open watches, stops the server and joins the thread, and fails if the server
    hit an internal error (a bug in the mock, reported as 500 to the client).
    """

    def __init__(self, emulator: Any = None, *, bookmark_interval: float = 1.0, token: str | None = None,
                 seed: int = 0) -> None:
        from tests.kube_mock.emulator import ClusterEmulator

        self.store = Store()
        self.api = Api(self.store, seed=seed)
        self.emulator: ClusterEmulator = emulator if emulator is not None else ClusterEmulator(seed=seed)
        self.emulator.attach(self.api)
        self.token = token
        self.handler = KubeApiHandler(api=self.api, after_write=self.emulator.after_api_write, token=token,
                                      bookmark_interval=bookmark_interval)
        self._url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._clients: list[kubernetes.client.ApiClient] = []

    # --- lifecycle

    def __enter__(self) -> KubeMock:
        self._thread = threading.Thread(target=self._run, name="kube-mock", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._failure is not None or self._url is None:
            self._thread.join(5)
            raise RuntimeError("kube_mock failed to start") from self._failure
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)
            if self._thread.is_alive():
                raise RuntimeError("kube_mock's server thread did not stop")
        if self.handler.internal_errors and exc_info[0] is None:
            raise AssertionError("kube_mock had internal errors:\n" + "\n".join(self.handler.internal_errors))

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - handed to __enter__
            self._failure = exc
        finally:
            self._ready.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with self.handler, kmock.Server(self.handler, host="127.0.0.1") as server:
            self._url = f"http://127.0.0.1:{server.port}"
            self._ready.set()
            await self._stop.wait()
            for watch in list(self.handler.watches):
                watch.end(abruptly=False)
            for _ in range(200):  # let the streams finish their responses before the server closes
                if not self.handler.watches:
                    break
                await asyncio.sleep(0.01)

    # --- client side

    @property
    def url(self) -> str:
        assert self._url is not None, "enter the KubeMock first"
        return self._url

    def configuration(self) -> kubernetes.client.Configuration:
        config = kubernetes.client.Configuration()
        config.host = self.url
        if self.token is not None:
            config.api_key = {"BearerToken": self.token}
            config.api_key_prefix = {"BearerToken": "Bearer"}
        return config

    def api_client(self) -> kubernetes.client.ApiClient:
        """An ApiClient for this server; closed when the mock exits."""
        client = kubernetes.client.ApiClient(self.configuration())
        self._clients.append(client)
        return client

    # --- test side

    def objects(self, kind: str, namespace: str | None = None) -> list[dict]:
        """Copies of the stored objects of a kind (``"Deployment"`` or ``"deployments"``)."""
        return self.store.list(kind_of(kind), namespace)[0]

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        return self.store.get(kind_of(kind), namespace, name)

    @property
    def resource_version(self) -> str:
        return str(self.store.rv)

    def compact(self) -> str:
        """Drop the change history: a watch from an older resourceVersion gets 410 Expired."""
        return str(self.store.compact())

    def break_watches(self) -> int:
        """Drop every open watch connection abruptly (no end of the chunked response)."""
        watches = list(self.handler.watches)
        for watch in watches:
            self.store.unsubscribe(watch.push)
            self.handler.watches.discard(watch)
            watch.end(abruptly=True)
        return len(watches)

    def end_watches(self) -> int:
        """End every open watch gracefully, as a server-side timeout does."""
        watches = list(self.handler.watches)
        for watch in watches:
            self.handler.watches.discard(watch)
            watch.end(abruptly=False)
        return len(watches)

    def bookmark(self) -> int:
        """Send a BOOKMARK now on every open watch that allowed bookmarks."""
        watches = list(self.handler.watches)
        for watch in watches:
            watch.bookmark_requested = True
            watch.poke()
        return len(watches)

    @property
    def open_watches(self) -> int:
        return len(self.handler.watches)

    @property
    def requests(self) -> list[tuple[str, str, dict[str, str]]]:
        """Every request served so far: (method, path, query)."""
        return [(request.method.value.upper(), request.url.path, dict(request.params)) for request in self.handler]
