"""The router's HTTP surface (Starlette) and its proxy to replicas (aiohttp).

Routes parse, call :mod:`serving.router.admission`, then :class:`Proxy`. The table of
endpoints, replicas and tokens is refreshed in the background every
``refresh_interval_s`` and swapped in whole; a request takes the table only once its body
has been read, so a slow upload never lands on a replica retired meanwhile.

A request moves to another replica only when it cannot have reached the first (the
connection was refused or could not be made in time). Once it was sent, a replica that
stops answering is a 504 and one that closes the connection a 502: a generation never
runs twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timezone

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from serving.router import admission
from serving.router.admission import RouterError, Upstream
from serving.router import cost
from serving.router.balancing import p2c
from serving.router.config import RouterConfig
from serving.router.activator import Activator
from serving.router.latency import LatencyWindow
from serving.router.signals import InFlightWindow
from serving.router.table import RoutingTable

log = logging.getLogger("modelplane.router")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "server", "date"}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("modelplane_router_requests", "Requests by endpoint and status code.",
                                ["endpoint", "code"], registry=self.registry)
        self.latency = Histogram("modelplane_router_request_latency_seconds", "Time to the last byte.", ["endpoint"],
                                 registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.in_flight = Gauge("modelplane_router_in_flight", "Requests in flight per endpoint.", ["endpoint"],
                               registry=self.registry)
        self.retries = Counter("modelplane_router_retries", "Requests retried on another replica.", ["endpoint"],
                               registry=self.registry)
        self.in_flight_units = Gauge("modelplane_router_in_flight_model_units",
                                     "Model units in flight per endpoint (1 per request without a cost model).",
                                     ["endpoint"], registry=self.registry)
        # Drift: whole answers (not streams) of endpoints with a cost model, observed against predicted.
        self.cost_requests = Counter("modelplane_router_cost_checked_requests",
                                     "Answers whose latency was compared with the cost model.", ["endpoint"],
                                     registry=self.registry)
        self.cost_observed = Counter("modelplane_router_cost_observed_seconds",
                                     "Observed latency of those answers.", ["endpoint"], registry=self.registry)
        self.cost_predicted = Counter("modelplane_router_cost_predicted_seconds",
                                      "The cost model's latency for the same answers.", ["endpoint"],
                                      registry=self.registry)


class Proxy:
    """Sends a request to a replica picked by P2C, retrying others on connect failure.

    Every request taken to a replica and given back is also told to ``signals`` at
    ``clock()`` (wall-clock seconds, see :mod:`serving.router.signals`)."""

    def __init__(self, config: RouterConfig, metrics: Metrics, signals: InFlightWindow,
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.signals = signals
        self._clock = clock
        self.in_flight: dict[str, float] = defaultdict(float)  # model units per replica URL
        self.mean_output: dict[str, float] = {}  # per endpoint: reported completion tokens, EWMA
        self._rng = rng or random.Random()
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # No total deadline: it would cut a long LLM stream mid-body. A replica silent for
        # request_timeout_s between two reads is what times out.
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s,
                                        sock_read=self.config.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.config.keepalive_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def send(self, upstream: Upstream) -> Response:
        units = cost.request_units(upstream.payload, upstream.route.cost, self.mean_output.get(upstream.route.name))
        self.metrics.in_flight_units.labels(upstream.route.name).inc(units)
        try:
            return await self._send(upstream, units)
        finally:
            self.metrics.in_flight_units.labels(upstream.route.name).dec(units)

    async def _send(self, upstream: Upstream, units: float) -> Response:
        tried: list[str] = []
        last_error = ""
        for attempt in range(self.config.max_attempts):
            candidates = [url for url in upstream.route.replicas if url not in tried]
            if not candidates:
                break
            url = p2c.pick(candidates, self.in_flight, self._rng)
            tried.append(url)
            if attempt:
                self.metrics.retries.labels(upstream.route.name).inc()
            self.in_flight[url] += units
            self.signals.started(upstream.route.name, url, units, self._clock(), retry=attempt > 0)
            sent = time.perf_counter()
            try:
                # identity: bodies are relayed as they come, so they must not come compressed
                response = await self.session.post(f"{url}{upstream.path}", data=upstream.body,
                                                   headers={"Content-Type": "application/json",
                                                            "Accept-Encoding": "identity"})
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                # No connection was made, so the replica never saw the request: safe to try another.
                self._release(upstream.route.name, url, units)
                last_error = f"{type(exc).__name__}: {exc}"
                log.warning("replica %s could not be reached (%s); trying another", url, last_error)
                continue
            except BaseException as exc:
                self._release(upstream.route.name, url, units)
                raise self._after_sending(upstream, exc) from None
            return await self._relay(url, response, upstream, units, sent)
        raise RouterError(503, f"no replica of {upstream.route.name!r} could be reached ({last_error}); retry shortly",
                          {"Retry-After": str(self.config.retry_after_s)})

    def _after_sending(self, upstream: Upstream, exc: BaseException) -> BaseException:
        """The error for a replica that failed once it may have received the request (never retried)."""
        name = upstream.route.name
        if isinstance(exc, asyncio.TimeoutError):
            return RouterError(504, f"replica of {name!r} stopped answering for {self.config.request_timeout_s:.0f} s; "
                                    "the request was not retried, as it may be running there")
        if isinstance(exc, aiohttp.ClientConnectionError):
            return RouterError(502, f"replica of {name!r} closed the connection before answering ({exc}); the "
                                    "request was not retried, as it may have run there")
        if isinstance(exc, aiohttp.ClientError):
            return RouterError(502, f"replica of {name!r} answered badly: {exc}")
        return exc

    async def _read_bounded(self, response: aiohttp.ClientResponse, endpoint: str) -> bytes:
        limit = self.config.max_response_bytes
        declared = response.content_length
        content = None if declared is not None and declared > limit else await _read_all(response, limit)
        if content is None:
            raise RouterError(502, f"replica of {endpoint!r} answered with a body larger than {limit} bytes; ask for "
                                   "less (e.g. fewer rows or tokens) or stream the answer")
        return content

    def _release(self, endpoint: str, url: str, units: float) -> None:
        self.in_flight[url] -= units
        if self.in_flight[url] <= 1e-9:
            del self.in_flight[url]
        self.signals.ended(endpoint, url, units, self._clock())

    def _observe(self, upstream: Upstream, status: int, content: bytes, latency_s: float) -> None:
        """Learn the endpoint's mean output length and compare latency with the cost model.

        Only endpoints with a cost model price requests, so only their answers are parsed."""
        if upstream.route.cost is None or status != 200 or upstream.payload is None or len(content) > 1_000_000:
            return
        try:
            completion_tokens = json.loads(content)["usage"]["completion_tokens"]
        except (ValueError, KeyError, TypeError):
            return
        if not isinstance(completion_tokens, int):
            return
        name = upstream.route.name
        self.mean_output[name] = cost.updated_mean(self.mean_output.get(name), completion_tokens)
        predicted_ms = upstream.route.cost.latency_ms(cost.input_tokens(upstream.payload), completion_tokens)
        self.metrics.cost_requests.labels(name).inc()
        self.metrics.cost_observed.labels(name).inc(latency_s)
        self.metrics.cost_predicted.labels(name).inc(predicted_ms / 1000)

    async def _relay(self, url: str, response: aiohttp.ClientResponse, upstream: Upstream, units: float,
                     sent: float) -> Response:
        headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}
        if not response.content_type.startswith("text/event-stream"):
            try:
                content = await self._read_bounded(response, upstream.route.name)
            except aiohttp.ClientError as exc:
                raise RouterError(502, f"replica of {upstream.route.name!r} broke off its answer: {exc}") from None
            except asyncio.TimeoutError:
                raise RouterError(504, f"replica of {upstream.route.name!r} stopped answering for "
                                       f"{self.config.request_timeout_s:.0f} s") from None
            finally:
                response.release()
                self._release(upstream.route.name, url, units)
            self._observe(upstream, response.status, content, time.perf_counter() - sent)
            return Response(content, status_code=response.status, headers=headers)

        async def chunks():
            # A stream the replica cuts short ends here; the client sees the body end early.
            try:
                async for chunk in response.content.iter_any():
                    yield chunk
            finally:
                response.release()
                self._release(upstream.route.name, url, units)

        return StreamingResponse(chunks(), status_code=response.status, headers=headers,
                                 media_type=response.content_type)


async def _read_all(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None as soon as it grows past ``limit`` bytes."""
    chunks, size = [], 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def error_response(exc: RouterError) -> JSONResponse:
    return JSONResponse({"error": {"message": str(exc), "code": exc.status}}, status_code=exc.status,
                        headers=exc.headers)


def create_app(config: RouterConfig, load_table: Callable[[], RoutingTable],
               report: Callable[[datetime], None] | None = None, router_id: str | None = None,
               clock: Callable[[], float] = time.time) -> Starlette:
    """The router app; ``load_table`` is called off the event loop every refresh interval.

    ``report`` (off the event loop too) is told, after each refresh, when the read of the
    table now served began: a rollout drains a replaced revision only once every router has
    reported a table read after the switch (``controlplane.routers``).

    ``router_id`` names this router in ``/internal/in-flight`` (default ``host:port``);
    ``clock`` gives the wall-clock seconds its buckets are keyed by: wall time, not
    monotonic, so that the buckets of several routers line up (:mod:`serving.router.signals`).
    """
    metrics = Metrics()
    signals = InFlightWindow(router_id or f"{socket.gethostname()}:{config.port}")
    latencies = LatencyWindow()
    activator = Activator(max_waiting=config.max_waiting_per_endpoint, factor=config.hold_cold_start_factor,
                          margin_s=config.hold_margin_s, low_s=config.hold_min_s, high_s=config.hold_max_s,
                          poll_s=min(0.1, config.refresh_interval_s), retry_after_s=config.retry_after_s)
    proxy = Proxy(config, metrics, signals, clock)
    limits = config.limits()
    # "read_at": when the read that produced the current table began; the table shows the
    # database as it was at that moment or later.
    state = {"table": RoutingTable(), "read_at": -1.0}
    reload_lock = asyncio.Lock()

    async def refresh() -> None:
        started, began_at = time.monotonic(), datetime.now(timezone.utc)
        table = await asyncio.to_thread(load_table)
        if started > state["read_at"]:  # a slow read never replaces a newer one
            state["table"], state["read_at"] = table, started
            signals.retain({name: route.replicas for name, route in table.endpoints.items()})
            if report is not None:
                try:
                    await asyncio.to_thread(report, began_at)
                except Exception:  # noqa: BLE001 - a missed report only makes a drain wait longer
                    log.exception("reporting the routing table's version failed")

    async def refresh_forever() -> None:
        while True:
            try:
                await refresh()
            except Exception:  # noqa: BLE001 - keep serving the last good table
                log.exception("refreshing the routing table failed; keeping the previous one")
            await asyncio.sleep(config.refresh_interval_s)

    async def authenticate(request: Request):
        """A token created a moment ago may be newer than the table: on a miss, make sure the
        table was read after this request arrived (reading it again if not) before answering 401.

        Reloads are serialized, and one read serves every miss that arrived before it began,
        so a burst of unknown tokens costs one read per burst, not one per request.
        """
        arrived = time.monotonic()
        try:
            return admission.authenticate(request.headers.get("authorization"), state["table"])
        except RouterError as exc:
            if exc.status != 401:
                raise
            async with reload_lock:
                if state["read_at"] < arrived:
                    try:
                        await refresh()
                    except Exception:  # noqa: BLE001 - the database being down is no reason to 500
                        log.exception("reloading the routing table for an unknown token failed")
                        raise exc from None
            return admission.authenticate(request.headers.get("authorization"), state["table"])

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await refresh()
        await proxy.start()
        refresher = asyncio.create_task(refresh_forever())
        yield
        refresher.cancel()
        await proxy.close()

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise RouterError(413, f"body is {declared} bytes; this router accepts at most {config.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise RouterError(413, f"body is larger than {config.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def handle(request: Request, endpoint_of: Callable, build: Callable) -> Response:
        started = time.perf_counter()
        endpoint, revision_id = "-", None
        try:
            grant = await authenticate(request)
            body = await read_body(request)
            table = state["table"]  # after the upload: the replicas ready now, not when it began
            endpoint, payload = endpoint_of(request, body)
            route = admission.authorize(grant, endpoint, table, config.retry_after_s)
            route = await activator.ready_route(route, lambda: state["table"].endpoints.get(endpoint))
            revision_id = route.revision_id
            upstream = build(route, payload, body)
            metrics.in_flight.labels(endpoint).inc()
            try:
                response = await proxy.send(upstream)
            finally:
                metrics.in_flight.labels(endpoint).dec()
        except RouterError as exc:
            response = error_response(exc)
        known = endpoint if endpoint in state["table"].endpoints else "-"
        metrics.requests.labels(known, str(response.status_code)).inc()
        metrics.latency.labels(known).observe(time.perf_counter() - started)
        if known != "-":
            latencies.observe(known, 1000 * (time.perf_counter() - started), clock(), response.status_code, revision_id)
        return response

    async def invocations(request: Request) -> Response:
        return await handle(request, lambda r, body: (r.path_params["name"], None),
                            lambda route, _payload, body: admission.for_invocations(route, body, limits))

    def openai_route(path: str):
        async def route_handler(request: Request) -> Response:
            return await handle(request, lambda _r, body: admission.openai_endpoint(body, limits),
                                lambda route, payload, body: admission.for_openai(route, path, payload, body, limits))
        return route_handler

    async def models(request: Request) -> Response:
        try:
            grant = await authenticate(request)
        except RouterError as exc:
            return error_response(exc)
        data = [{"id": name, "object": "model", "owned_by": "modelplane", "ready": bool(route.replicas)}
                for name, route in sorted(state["table"].endpoints.items()) if route.runtime == "vllm" and grant.allows(name)]
        return JSONResponse({"object": "list", "data": data})

    async def healthz(_request: Request) -> Response:
        return JSONResponse({"status": "ok", "endpoints": len(state["table"].endpoints)})

    async def metrics_route(_request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def in_flight(request: Request) -> Response:
        """Work in flight here by second, for the autoscaler; ``?since_s=`` (a UNIX second) trims
        the buckets to those not yet read, ``?replica_buckets=true`` adds each replica's."""
        try:
            admission.authorize_admin(await authenticate(request), "/internal/in-flight")
            since = request.query_params.get("since_s")
            if since is not None and not (since.isascii() and since.isdigit()):
                raise RouterError(400, f"since_s must be a whole UNIX second, e.g. {int(clock())}; got {since!r}")
            per_replica = request.query_params.get("replica_buckets", "false")
            if per_replica not in ("true", "false"):
                raise RouterError(400, f"replica_buckets must be true or false; got {per_replica!r}")
        except RouterError as exc:
            return error_response(exc)
        now_s = clock()
        snapshot = signals.snapshot(now_s, None if since is None else int(since), per_replica == "true")
        for name, summary in latencies.summary(now_s).items():  # p99 and answers of the last 30 s
            snapshot["endpoints"].setdefault(name, {"in_flight_requests": 0, "in_flight_units": 0.0}).update(summary)
        for name, waiting in activator.waiting.items():
            snapshot["endpoints"].setdefault(name, {"in_flight_requests": 0, "in_flight_units": 0.0})[
                "waiting_requests"] = waiting
        return JSONResponse(snapshot)

    app = Starlette(
        routes=[
            Route("/serving-endpoints/{name}/invocations", invocations, methods=["POST"]),
            Route("/v1/completions", openai_route("/v1/completions"), methods=["POST"]),
            Route("/v1/chat/completions", openai_route("/v1/chat/completions"), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics_route, methods=["GET"]),
            Route("/internal/in-flight", in_flight, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.proxy = proxy
    app.state.signals = signals
    app.state.activator = activator
    app.state.routing = state
    return app


def main() -> None:
    import uvicorn

    import os
    import socket

    from controlplane.db import make_engine
    from controlplane.routers import RouterStore
    from controlplane.settings import Settings
    from cluster.hardware import detect_local
    from serving.router.table import load_table

    settings = Settings.from_env()
    config = RouterConfig(host=settings.host, port=settings.ports.router_port)
    engine = make_engine(settings.database_url)
    hardware = detect_local().key  # the local backend's replicas run on this machine
    routers, router_id = RouterStore(engine), f"{socket.gethostname()}:{config.port}:{os.getpid()}"
    try:
        uvicorn.run(create_app(config, lambda: load_table(engine, hardware), router_id=router_id,
                               report=lambda read_at: routers.report(router_id, read_at, f"http://{config.host}:{config.port}")),
                    host=config.host, port=config.port, log_level="warning", loop="uvloop", http="httptools")
    finally:
        routers.forget(router_id)


if __name__ == "__main__":
    main()
