"""The router's proxy to replicas (aiohttp): pick, send, retry before sending, relay, eject, shadow.

A request moves to another replica only when it cannot be running on the first: the
connection was refused or could not be made in time, or the connection broke before any
answer and the replica no longer accepts connections (its process died, and the request's
work with it: a SIGKILLed or crashed replica). Otherwise, once it was sent, a replica that
stops answering is a 504 and one that closes the connection but still listens a 502: a
generation never runs twice.

Per request: the revision (the serving one, or the canary by its share,
``serving.router.traffic``), then the replica: by the endpoint's sticky key within its load
bound if it has one (``balancing.sticky``), else by its balancer (``balancing``), never an
ejected one while another is left (``serving.router.outliers``). Every answer, and every
failed connect, is told to the outlier detector. A shadow copy goes out beside the request
and is read to its end and discarded: it can neither answer nor fail the client.

A replica is sent the body, its type, and the request's W3C trace headers: the client's as
they came, or, with a tracer, ones naming the router's span as parent (``serving.router.tracing``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from urllib.parse import urlsplit

import aiohttp
from starlette.responses import Response, StreamingResponse

from serving.blame import FAULT_HEADER, MODEL_FAULT
from serving.router import cost, traffic
from serving.router.admission import RouterError, Upstream
from serving.router.balancing import make_balancer
from serving.router.balancing.base import Snapshot
from serving.router.balancing.sticky import bounded_pick, ring_for
from serving.router.config import RouterConfig
from serving.router.exchange import Exchange, ending_span, read_all, replica_headers
from serving.router.latency import LatencyWindow
from serving.router.metrics import Metrics
from serving.router.outliers import OutlierDetector
from serving.router.signals import InFlightWindow
from serving.router.table import EndpointRoute
from serving.router.tracing import Tracer

log = logging.getLogger("modelplane.router")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "server", "date"}


class Proxy:
    """Sends requests to replicas. Every request taken to a replica and given back is also told
    to ``signals`` at ``clock()`` (wall-clock seconds, see :mod:`serving.router.signals`);
    ``monotonic()`` times ejections."""

    def __init__(self, config: RouterConfig, metrics: Metrics, signals: InFlightWindow,
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None,
                 monotonic: Callable[[], float] = time.monotonic, tracer: Tracer | None = None) -> None:
        """``tracer``: a span per request (:mod:`serving.router.tracing`); None: the client's trace
        headers are forwarded as they came, and nothing more is done."""
        self.config = config
        self.tracer = tracer
        self.metrics = metrics
        self.signals = signals
        self._clock, self._monotonic = clock, monotonic
        self.in_flight: dict[str, float] = defaultdict(float)  # model units per replica URL
        self.in_flight_requests: dict[str, int] = defaultdict(int)
        self.mean_output: dict[str, float] = {}  # per endpoint: reported completion tokens, EWMA
        self._rng = rng or random.Random()
        self._balancers: dict[tuple[str, str], object] = {}
        self.detectors: dict[str, OutlierDetector] = {}
        self.shadow_latencies = LatencyWindow()
        self._shadows: set[asyncio.Task] = set()
        # told each shadow copy's outcome: (route, revision id, status, latency ms, request body, answer bytes)
        self.on_shadow: Callable[..., None] | None = None
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # No total deadline: it would cut a long LLM stream mid-body. A replica silent for
        # request_timeout_s between two reads is what times out.
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s,
                                        sock_read=self.config.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.config.keepalive_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)

    async def close(self) -> None:
        for task in list(self._shadows):
            task.cancel()
        if self.session is not None:
            await self.session.close()

    def units(self, upstream: Upstream, cost_model=None) -> float:
        """The request's model units, on ``cost_model`` (default: the serving revision's)."""
        model = upstream.route.cost if cost_model is None else cost_model
        return cost.request_units(upstream.payload, model, self.mean_output.get(upstream.route.name))

    # -- picking -----------------------------------------------------------------------------

    def detector(self, route: EndpointRoute) -> OutlierDetector:
        detector = self.detectors.get(route.name)
        if detector is None or detector.config != route.policy.ejection:
            detector = self.detectors[route.name] = OutlierDetector(route.policy.ejection)
        return detector

    def _balancer(self, endpoint: str, name: str):
        balancer = self._balancers.get((endpoint, name))
        if balancer is None:
            balancer = self._balancers[(endpoint, name)] = make_balancer(name)
        return balancer

    def pick(self, route: EndpointRoute, replicas: tuple[str, ...], candidates: list[str], units: float,
             key: str | None) -> str:
        policy = route.policy
        snapshot = Snapshot(self.in_flight, self.in_flight_requests, self.detector(route).ejected(self._monotonic()),
                            units)
        balancer = self._balancer(route.name, policy.balancer)
        if key is not None and len(candidates) == len(replicas) > 1:
            url, home = bounded_pick(key, candidates, snapshot, ring_for(replicas), policy.load_factor, balancer,
                                     self._rng)
            self.metrics.sticky.labels(route.name, "true" if home else "false").inc()
            return url
        return balancer.pick(candidates, snapshot, self._rng)

    def _outcome(self, route: EndpointRoute, replicas: tuple[str, ...], url: str, failed: bool) -> None:
        detector, now = self.detector(route), self._monotonic()
        if failed:
            if detector.failure(url, replicas, now):
                self.metrics.ejections.labels(route.name).inc()
                log.warning("replica %s of %s ejected as an outlier", url, route.name)
        else:
            detector.success(url, now)

    # -- sending -----------------------------------------------------------------------------

    async def send(self, upstream: Upstream, units: float, key: str | None = None,
                   exchange: Exchange | None = None, on_done: Callable[[Exchange], None] | None = None) -> Response:
        """The replica's answer (a stream passes through). ``on_done`` is called with ``exchange``
        once the answer is complete (for a stream: when it ends, however it ends)."""
        route, exchange = upstream.route, exchange or Exchange()
        span = None
        if self.tracer is not None:  # the replica (and a shadow copy) get the router span as parent
            span = self.tracer.start(route.name, upstream.trace_headers)
            upstream = replace(upstream, trace_headers=span.headers)
            on_done = ending_span(span, on_done)
        revision_id, replicas, role = traffic.choose(route.replicas, route.revision_id, route.canary, self._rng)
        exchange.revision_id, exchange.role = revision_id, role
        if role == "canary" and route.canary.cost is not None:  # priced on the revision that runs it
            units = self.units(upstream, route.canary.cost)
        shadow = traffic.shadow_for(route.shadow, self._rng)
        if shadow is not None:
            self._start_shadow(upstream, shadow)
        try:
            return await self._send(upstream, replicas, units, key, exchange, on_done)
        except RouterError as exc:
            exchange.status = exc.status
            if on_done is not None:
                on_done(exchange)
            raise
        except BaseException:  # cancelled: the caller finishes the request, the span ends here
            if span is not None:
                span.end(exchange.revision_id, exchange.replica_url, exchange.status, exchange.retries)
            raise

    async def _send(self, upstream: Upstream, replicas: tuple[str, ...], units: float, key: str | None,
                    exchange: Exchange, on_done) -> Response:
        route = upstream.route
        tried: list[str] = []
        last_error = ""
        for attempt in range(self.config.max_attempts):
            candidates = [url for url in replicas if url not in tried]
            if not candidates:
                break
            url = self.pick(route, replicas, candidates, units, key)
            tried.append(url)
            exchange.replica_url, exchange.retries = url, attempt
            if attempt:
                self.metrics.retries.labels(route.name).inc()
            self._take(route.name, url, units, attempt)
            sent = time.perf_counter()
            try:
                response = await self.session.post(f"{url}{upstream.path}", data=upstream.body,
                                                   headers=replica_headers(upstream))
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                # No connection was made, so the replica never saw the request: safe to try another.
                self._release(route.name, url, units)
                self._outcome(route, replicas, url, failed=True)
                last_error = f"{type(exc).__name__}: {exc}"
                log.warning("replica %s could not be reached (%s); trying another", url, last_error)
                continue
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                self._release(route.name, url, units)
                self._outcome(route, replicas, url, failed=True)
                if not await self._gone(url):
                    raise self._after_sending(upstream, exc) from None
                last_error = f"{type(exc).__name__}: {exc}, and it no longer accepts connections"
                log.warning("replica %s died with the request (%s); trying another", url, last_error)
                continue
            except BaseException as exc:
                self._release(route.name, url, units)
                if not isinstance(exc, asyncio.CancelledError):  # a timeout or a reset counts against it
                    self._outcome(route, replicas, url, failed=True)
                raise self._after_sending(upstream, exc) from None
            exchange.status = response.status
            return await self._relay(url, response, upstream, units, sent, exchange, on_done,
                                     lambda failed: self._outcome(route, replicas, url, failed))
        raise RouterError(503, f"no replica of {route.name!r} could be reached ({last_error}); retry shortly",
                          {"Retry-After": str(self.config.retry_after_s)})

    async def _gone(self, url: str) -> bool:
        """Whether the replica at ``url`` refuses connections now: its process is gone (the
        kernel closed its listening socket), so nothing it was sent can still be running."""
        address = urlsplit(url)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(address.hostname, address.port),
                                                    self.config.connect_timeout_s)
        except (ConnectionRefusedError, ConnectionResetError):
            return True
        except (OSError, asyncio.TimeoutError):
            return False  # unreachable is not proof of death: the request may be running there
        try:
            # A process group dies one process at a time: a worker may hold the listening socket
            # a moment longer, and then the connection the kernel accepted for it is reset. A
            # live server keeps an idle new connection open.
            return await asyncio.wait_for(reader.read(1), self.config.connect_timeout_s / 4) == b""
        except ConnectionResetError:
            return True
        except (OSError, asyncio.TimeoutError):
            return False
        finally:
            writer.close()

    def _take(self, endpoint: str, url: str, units: float, attempt: int) -> None:
        self.in_flight[url] += units
        self.in_flight_requests[url] += 1
        self.signals.started(endpoint, url, units, self._clock(), retry=attempt > 0)

    def _release(self, endpoint: str, url: str, units: float) -> None:
        self._untake(url, units)
        self.signals.ended(endpoint, url, units, self._clock())

    def _untake(self, url: str, units: float) -> None:
        self.in_flight[url] -= units
        if self.in_flight[url] <= 1e-9:
            del self.in_flight[url]
        self.in_flight_requests[url] -= 1
        if self.in_flight_requests[url] <= 0:
            del self.in_flight_requests[url]

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
        content = None if declared is not None and declared > limit else await read_all(response, limit)
        if content is None:
            raise RouterError(502, f"replica of {endpoint!r} answered with a body larger than {limit} bytes; ask for "
                                   "less (e.g. fewer rows or tokens) or stream the answer")
        return content

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
                     sent: float, exchange: Exchange, on_done, outcome: Callable[[bool], None]) -> Response:
        """Relay the answer; ``outcome`` is told whether the replica failed (a 5xx, or an answer
        broken off or timed out), once the whole answer is in (a stream: once it started)."""
        headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}
        name = upstream.route.name
        if not response.content_type.startswith("text/event-stream"):
            try:
                content = await self._read_bounded(response, name)
            except aiohttp.ClientError as exc:
                outcome(True)
                raise RouterError(502, f"replica of {name!r} broke off its answer: {exc}") from None
            except asyncio.TimeoutError:
                outcome(True)
                raise RouterError(504, f"replica of {name!r} stopped answering for "
                                       f"{self.config.request_timeout_s:.0f} s") from None
            finally:
                response.release()
                self._release(name, url, units)
            outcome(response.status >= 500)
            self._observe(upstream, response.status, content, time.perf_counter() - sent)
            exchange.add(content)
            if on_done is not None:
                on_done(exchange)
            return Response(content, status_code=response.status, headers=headers)

        outcome(response.status >= 500)

        async def chunks():
            # A stream the replica cuts short ends here; the client sees the body end early.
            try:
                async for chunk in response.content.iter_any():
                    exchange.add(chunk)
                    yield chunk
            finally:
                response.release()
                self._release(name, url, units)
                if on_done is not None:
                    on_done(exchange)

        return StreamingResponse(chunks(), status_code=response.status, headers=headers,
                                 media_type=response.content_type)

    # -- shadow copies ---------------------------------------------------------------------

    def _start_shadow(self, upstream: Upstream, shadow: traffic.Split) -> None:
        if len(self._shadows) >= self.config.max_shadow_in_flight:
            self.metrics.shadow_dropped.labels(upstream.route.name).inc()
            return
        task = asyncio.create_task(self._shadow(upstream, shadow))
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)

    async def _shadow(self, upstream: Upstream, shadow: traffic.Split) -> None:
        """Send the copy, read its answer to the end, keep only its status and latency."""
        name, units = upstream.route.name, self.units(upstream, shadow.cost)
        url = self._balancer(f"{name}#shadow", "p2c_units").pick(
            list(shadow.replicas), Snapshot(self.in_flight, self.in_flight_requests), self._rng)
        self.in_flight[url] += units
        self.in_flight_requests[url] += 1
        started, status, answered, model_fault = time.perf_counter(), 599, 0, False
        try:
            async with self.session.post(f"{url}{upstream.path}", data=upstream.body,
                                         headers=replica_headers(upstream)) as response:
                status = response.status
                model_fault = response.headers.get(FAULT_HEADER) == MODEL_FAULT
                content = await read_all(response, self.config.max_response_bytes)
                if content is None:
                    status = 502
                else:
                    answered = len(content)
        except Exception as exc:  # noqa: BLE001 - a shadow's failure is recorded, never raised
            log.info("shadow copy to %s (%s) failed: %s", url, shadow.revision_id, exc)
            status = 502
        finally:
            self._untake(url, units)
        latency_ms = 1000 * (time.perf_counter() - started)
        self.shadow_latencies.observe(name, latency_ms, self._clock(), status, shadow.revision_id, model_fault)
        self.metrics.revision_requests.labels(name, shadow.revision_id, "shadow", str(status)).inc()
        if self.on_shadow is not None:
            self.on_shadow(upstream.route, shadow.revision_id, status, latency_ms, upstream.body, answered)
