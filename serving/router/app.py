"""The router's HTTP surface (Starlette).

Routes parse, call :mod:`serving.router.admission` (who may call what, and what is sent),
:mod:`serving.router.gatekeeper` (rate limits and the wait queue), then
:class:`serving.router.proxy.Proxy`, and record what was served
(:mod:`serving.router.recorder`). The table of endpoints, replicas, tokens and routing
policies is refreshed in the background every ``refresh_interval_s`` and swapped in whole;
a request takes the table only once its body has been read, so a slow upload never lands on
a replica retired meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta, timezone

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serving.blame import FAULT_HEADER, MODEL_FAULT
from serving.router import admission, tracing
from serving.router.activator import Activator
from serving.router.admission import RouterError
from serving.router.balancing.keys import prefix_key, session_key
from serving.router.config import RouterConfig
from serving.router.errors import error_response
from serving.router.exchange import Exchange
from serving.router.openapi import DOCUMENT as OPENAPI
from serving.router.gatekeeper import Gatekeeper, acquire_unless_gone
from serving.router.inference_log import InferenceLogWriter, LogSink
from serving.router.latency import LatencyWindow
from serving.router.limits import check_content_type
from serving.router.metrics import Metrics
from serving.router.proxy import Proxy
from serving.router.recorder import Recorder
from serving.router.signals import InFlightWindow
from serving.router.table import EndpointRoute, RoutingTable
from serving.router.tracing import Tracer
from serving.router.unknown_tokens import UnknownTokens, read_since

log = logging.getLogger("modelplane.router")


def create_app(config: RouterConfig, load_table: Callable[[], RoutingTable],
               report: Callable[[datetime], None] | None = None, router_id: str | None = None,
               clock: Callable[[], float] = time.time, log_sink: LogSink | None = None,
               on_ready: Callable[[], None] | None = None, tracer: Tracer | None = None) -> Starlette:
    """The router app; ``load_table`` is called off the event loop every refresh interval.

    ``report`` (off the event loop too) is told, after each refresh, when the read of the
    table now served began: a rollout drains a replaced revision only once every router has
    reported a table read after the switch (``controlplane.routers``).

    ``router_id`` names this router in ``/internal/in-flight`` (default ``host:port``);
    ``clock`` gives the wall-clock seconds its buckets are keyed by: wall time, not
    monotonic, so that the buckets of several routers line up (:mod:`serving.router.signals`).
    ``log_sink`` receives the inference log's batches (none: nothing is recorded);
    ``on_ready`` is called once the first table is read and the proxy is up.
    ``tracer`` gives each proxied request a span (:mod:`serving.router.tracing`), and is closed
    (its last spans exported) when the app stops; None: trace headers are only forwarded.
    """
    metrics = Metrics()
    identity = router_id or f"{socket.gethostname()}:{config.port}"
    signals = InFlightWindow(identity)
    latencies = LatencyWindow()
    activator = Activator(max_waiting=config.max_waiting_per_endpoint, factor=config.hold_cold_start_factor,
                          margin_s=config.hold_margin_s, low_s=config.hold_min_s, high_s=config.hold_max_s,
                          poll_s=min(0.1, config.refresh_interval_s), retry_after_s=config.retry_after_s)
    proxy = Proxy(config, metrics, signals, clock, tracer=tracer)
    gatekeeper = Gatekeeper(retry_after_s=config.retry_after_s)
    writer = InferenceLogWriter(log_sink, max_buffer=config.log_buffer_records) if log_sink is not None else None
    recorder = Recorder(writer, identity)
    proxy.on_shadow = recorder.shadow
    limits = config.limits()
    # "read_at": when the read that produced the current table began; the table shows the
    # database as it was at that moment or later. "tried_at": when the last read began.
    state = {"table": RoutingTable(), "read_at": -1.0, "tried_at": -math.inf, "reading": None}
    reload_lock = asyncio.Lock()
    unknown_tokens = UnknownTokens()

    async def refresh() -> None:
        """Read the table, or join the read under way: two reads never run at once."""
        reading = state["reading"]
        if reading is None or reading.done():
            reading = state["reading"] = asyncio.ensure_future(read())
        await asyncio.shield(reading)

    async def read() -> None:
        started, began_at = time.monotonic(), datetime.now(timezone.utc)
        state["tried_at"] = started
        table = await asyncio.to_thread(load_table)
        if started > state["read_at"]:  # a slow read never replaces a newer one
            state["table"], state["read_at"] = table, started
            signals.retain({name: route.replicas + (route.canary.replicas if route.canary else ())
                            for name, route in table.endpoints.items()})
            for name, route in table.endpoints.items():
                if name in proxy.detectors:
                    proxy.detectors[name].forget_absent(route.replicas + (route.canary.replicas if route.canary else ()))
            if report is not None:
                try:
                    await asyncio.to_thread(report, began_at)
                except Exception:  # noqa: BLE001 - a missed report only makes a drain wait longer
                    log.exception("reporting the routing table's version failed")

    async def prune_forever() -> None:
        """Retention: every ``log_prune_interval_s``, delete each endpoint's records older than its
        ``inference_log.retention_days``, the first time at start (several routers doing it at once
        delete nothing twice). Records of an endpoint that no longer exists are left alone."""
        first = True
        while True:
            await asyncio.sleep(0 if first else config.log_prune_interval_s)
            first, now = False, datetime.now(timezone.utc)
            for name, route in list(state["table"].endpoints.items()):
                try:
                    await asyncio.to_thread(log_sink.prune, now - timedelta(days=route.policy.log_retention_days),
                                            name)
                except Exception:  # noqa: BLE001 - retention is retried at the next interval
                    log.exception("pruning the inference log of %s failed", name)

    async def refresh_forever() -> None:
        while True:  # one read per interval, counting the reads unknown tokens asked for
            wait_s = state["tried_at"] + config.refresh_interval_s - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
                continue
            try:
                await refresh()
            except Exception:  # noqa: BLE001 - keep serving the last good table
                log.exception("refreshing the routing table failed; keeping the previous one")

    async def authenticate(request: Request):
        """A token created a moment ago may be newer than the table: on a miss, make sure the
        table was read after this request arrived before answering 401. Misses share reads
        (one read serves every miss that arrived before it began), reads begin at most once per
        ``unknown_token_reread_s``, and a token a read did not find is refused without another
        (:mod:`serving.router.unknown_tokens`).
        """
        arrived, authorization = time.monotonic(), request.headers.get("authorization")
        try:
            return admission.authenticate(authorization, state["table"])
        except RouterError as exc:
            key = admission.token_key(authorization)
            if exc.status != 401 or key is None or key in unknown_tokens:
                raise
            async with reload_lock:
                try:
                    await read_since(arrived, state, refresh, config.unknown_token_reread_s)
                except Exception:  # noqa: BLE001 - the database being down is no reason to 500
                    log.exception("reloading the routing table for an unknown token failed")
                    raise exc from None
            try:
                return admission.authenticate(authorization, state["table"])
            except RouterError:
                unknown_tokens.add(key)
                raise

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await refresh()
        await proxy.start()
        refresher = asyncio.create_task(refresh_forever())
        if on_ready is not None:
            on_ready()
        log_tasks = [asyncio.create_task(writer.run())] if writer is not None else []
        if hasattr(log_sink, "prune"):
            log_tasks.append(asyncio.create_task(prune_forever()))
        yield
        refresher.cancel()
        if writer is not None:
            await writer.close()
        for task in log_tasks:
            task.cancel()
        await proxy.close()
        if tracer is not None:
            await asyncio.to_thread(tracer.close)

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

    async def handle(request: Request, endpoint_of: Callable, build: Callable, mlflow: bool = False) -> Response:
        started, arrived = time.perf_counter(), datetime.now(timezone.utc)
        endpoint, exchange = "-", Exchange()
        try:
            grant = await authenticate(request)
            content_type = check_content_type(request.headers.get("content-type"))
            body = await read_body(request)
            table = state["table"]  # after the upload: the replicas ready now, not when it began
            endpoint, payload = endpoint_of(request, body, content_type)
            route = admission.authorize(grant, endpoint, table, config.retry_after_s)
            upstream = build(route, payload, body, content_type)
            units = proxy.units(upstream)
            try:
                gatekeeper.check_rates(route, grant, units)
            except RouterError as exc:
                metrics.limited.labels(endpoint, getattr(exc, "limit", "")).inc()
                raise
            route = await activator.ready_route(route, lambda: state["table"].endpoints.get(endpoint))
            upstream = replace(upstream, route=route, trace_headers=tracing.incoming(
                request.headers.getlist("traceparent"), request.headers.getlist("tracestate")))
            response = await send(request, route, upstream, units, grant.token_id, body, arrived, started, exchange)
        except RouterError as exc:
            response = error_response(exc, mlflow)
        known = endpoint if endpoint in state["table"].endpoints else "-"
        metrics.requests.labels(known, str(response.status_code)).inc()
        metrics.latency.labels(known).observe(time.perf_counter() - started)
        if known != "-":
            latencies.observe(known, 1000 * (time.perf_counter() - started), clock(), response.status_code,
                              exchange.revision_id, response.headers.get(FAULT_HEADER) == MODEL_FAULT)
            if exchange.revision_id is not None:
                metrics.revision_requests.labels(known, exchange.revision_id, exchange.role,
                                                 str(response.status_code)).inc()
        return response

    async def send(request: Request, route: EndpointRoute, upstream, units: float, token_id: str, body: bytes,
                   arrived: datetime, started: float, exchange: Exchange) -> Response:
        """Wait for a slot (if the endpoint caps its concurrency), send, and release the slot and
        write the log record once the answer is complete (for a stream, when it ends)."""
        gate = gatekeeper.gate(route)
        if gate is not None:
            await acquire_unless_gone(gate, request)
        record = recorder.on_done(route, token_id, body, arrived, started) if recorder.sampled(route) else None
        exchange.keep_bytes = recorder.keep_bytes(route) if record is not None else 0
        finished = False

        def done(outcome: Exchange) -> None:
            nonlocal finished
            if finished:
                return
            finished = True
            metrics.in_flight.labels(route.name).dec()
            metrics.in_flight_units.labels(route.name).dec(units)
            if gate is not None:
                gate.release()
            if record is not None:
                record(outcome)

        # until the answer is complete: for a stream, its end, not its first byte
        metrics.in_flight.labels(route.name).inc()
        metrics.in_flight_units.labels(route.name).inc(units)
        try:
            return await proxy.send(upstream, units, sticky_key(request, route, upstream.payload), exchange, done)
        except BaseException:
            done(exchange)
            raise

    def sticky_key(request: Request, route: EndpointRoute, payload: dict | None) -> str | None:
        policy = route.policy
        if policy.sticky == "session":
            return session_key(request.headers, policy.session_header)
        if policy.sticky == "prefix" and payload is not None:
            return prefix_key(payload, policy.prefix_chars)
        return None

    async def invocations(request: Request) -> Response:
        return await handle(request, lambda r, _body, _type: (r.path_params["name"], None),
                            lambda route, _payload, body, content_type: admission.for_invocations(
                                route, body, limits, content_type), mlflow=True)

    def openai_route(path: str):
        async def route_handler(request: Request) -> Response:
            return await handle(request, lambda _r, body, content_type: admission.openai_endpoint(body, limits,
                                                                                                  content_type),
                                lambda route, payload, body, _type: admission.for_openai(route, path, payload, body,
                                                                                         limits))
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
        for name, gate in list(gatekeeper.gates.items()):
            metrics.queued.labels(name).set(gate.waiting)
        now = time.monotonic()
        for name, detector in list(proxy.detectors.items()):
            metrics.ejected.labels(name).set(len(detector.ejected(now)))
        if writer is not None:
            metrics.log_written.set(writer.written)
            metrics.log_dropped.set(writer.dropped)
            metrics.log_failed.set(writer.failed)
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
        for name, summary in proxy.shadow_latencies.summary(now_s).items():  # beside the serving revision's
            snapshot["endpoints"].setdefault(name, {"in_flight_requests": 0, "in_flight_units": 0.0})[
                "shadow"] = summary["revisions"]
        return JSONResponse(snapshot)

    async def replicas(request: Request) -> Response:
        """Each endpoint's ready replicas as this router sees them: work in flight, ejection."""
        try:
            admission.authorize_admin(await authenticate(request), "/internal/replicas")
        except RouterError as exc:
            return error_response(exc)
        now = time.monotonic()
        endpoints = {}
        for name, route in sorted(state["table"].endpoints.items()):
            status = {row["url"]: row for row in proxy.detector(route).status(now, route.replicas)}
            splits = [(route.revision_id, route.replicas, "serve")]
            splits += [(s.revision_id, s.replicas, role) for s, role in ((route.canary, "canary"),
                                                                         (route.shadow, "shadow")) if s is not None]
            endpoints[name] = {
                "balancer": route.policy.balancer, "sticky": route.policy.sticky,
                "canary": None if route.canary is None else {"revision": route.canary.revision_id,
                                                             "percent": route.canary.percent},
                "shadow": None if route.shadow is None else {"revision": route.shadow.revision_id,
                                                             "percent": route.shadow.percent},
                "replicas": [{"url": url, "revision": revision, "role": role,
                              "in_flight_requests": proxy.in_flight_requests.get(url, 0),
                              "in_flight_units": round(proxy.in_flight.get(url, 0.0), 3),
                              **{k: v for k, v in status.get(url, {}).items() if k != "url"}}
                             for revision, urls, role in splits for url in urls]}
        return JSONResponse({"router": identity, "endpoints": endpoints})

    app = Starlette(
        routes=[
            Route("/serving-endpoints/{name}/invocations", invocations, methods=["POST"]),
            Route("/v1/completions", openai_route("/v1/completions"), methods=["POST"]),
            Route("/v1/chat/completions", openai_route("/v1/chat/completions"), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics_route, methods=["GET"]),
            Route("/internal/in-flight", in_flight, methods=["GET"]),
            Route("/internal/replicas", replicas, methods=["GET"]),
            Route("/openapi.json", lambda _request: JSONResponse(OPENAPI), methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.proxy = proxy
    app.state.signals = signals
    app.state.activator = activator
    app.state.routing = state
    app.state.gatekeeper = gatekeeper
    app.state.log_writer = writer
    return app
