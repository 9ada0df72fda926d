"""W3C trace context through the router: always forwarded, a span of the router's own when configured.

Off (the default: no OTLP endpoint in the environment), a client's ``traceparent`` and
``tracestate`` go to the replica as they came, once the traceparent is well formed
(``00-<32 lowercase hex>-<16 lowercase hex>-<2 lowercase hex>``, neither id all zeros). A
malformed one is dropped with its tracestate, as W3C Trace Context says: the replica then
starts a trace of its own. Nothing of OpenTelemetry is imported; the cost is two header look-ups.

On (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, or ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces``,
as the OTLP exporters resolve them), every proxied request gets a span "router <endpoint>",
a child of the client's traceparent when it sent one (else the root of a new trace), and the
replica is sent a traceparent with the same trace id whose parent id is the router span's.
Spans leave in batches (``BatchSpanProcessor``) over OTLP/HTTP from a thread of the SDK's own;
:meth:`OtelTracer.close` flushes what is left.

Example: the client sends ``00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01``; tracing
off, the replica gets exactly that; tracing on, ``00-4bf92f3577b34da6a3ce929d0e0e4736-<the router
span's id>-01``, and the collector gets the router span with parent ``00f067aa0ba902b7``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
DEFAULT_SERVICE_NAME = "modelplane-router"


def incoming(traceparents: list[str], tracestates: list[str]) -> dict[str, str]:
    """The trace headers to forward, from every ``traceparent`` and ``tracestate`` header a client sent.

    >>> incoming(["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"], ["congo=t61rcWkgMzE"])
    {'traceparent': '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01', 'tracestate': 'congo=t61rcWkgMzE'}
    >>> incoming(["00-00000000000000000000000000000000-00f067aa0ba902b7-01"], ["congo=t61rcWkgMzE"])
    {}

    Several traceparent headers are as malformed as a bad one; several tracestate headers are
    one list, joined with commas (RFC 9110 5.3).
    """
    if len(traceparents) != 1 or not valid_traceparent(traceparents[0]):
        return {}
    headers = {TRACEPARENT: traceparents[0]}
    if tracestates:
        headers[TRACESTATE] = ",".join(tracestates)
    return headers


def valid_traceparent(value: str) -> bool:
    """Whether ``value`` is a version-00 W3C traceparent with non-zero trace and parent ids."""
    match = _TRACEPARENT.fullmatch(value)
    return match is not None and match[1] != "0" * 32 and match[2] != "0" * 16


@dataclass(frozen=True)
class TracingConfig:
    """Where spans go: ``traces_endpoint`` (the full OTLP/HTTP URL, e.g.
    ``http://collector:4318/v1/traces``; None: no export, headers forwarded only), under
    ``service_name``."""

    traces_endpoint: str | None = None
    service_name: str = DEFAULT_SERVICE_NAME

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "TracingConfig":
        """The standard OpenTelemetry variables, resolved as the OTLP/HTTP exporter resolves them.

        >>> TracingConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"})
        TracingConfig(traces_endpoint='http://collector:4318/v1/traces', service_name='modelplane-router')
        >>> TracingConfig.from_env({}).traces_endpoint is None
        True
        """
        return cls(traces_endpoint=otlp_traces_endpoint(environ),
                   service_name=environ.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_NAME)


def otlp_traces_endpoint(environ: Mapping[str, str]) -> str | None:
    """``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` as it is, else ``OTEL_EXPORTER_OTLP_ENDPOINT`` with
    ``/v1/traces`` appended (the OTLP/HTTP rule); None when neither is set."""
    if traces := environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return traces
    if base := environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        return f"{base.removesuffix('/')}/v1/traces"
    return None


class Span(Protocol):
    headers: dict[str, str]  # the trace headers the replica is sent

    def end(self, revision_id: str | None, replica_url: str | None, status: int, retries: int) -> None:
        """Record what became of the request and end the span (once; later calls do nothing)."""


class Tracer(Protocol):
    def start(self, endpoint: str, headers: Mapping[str, str]) -> Span:
        """A span for one proxied request, child of the client's trace ``headers`` (see :func:`incoming`)."""

    def close(self) -> None:
        """Export what is left (blocking: call it off the event loop)."""


def tracer_from_env(environ: Mapping[str, str]) -> "OtelTracer | None":
    """The router's tracer, or None (off) when no OTLP endpoint is configured."""
    config = TracingConfig.from_env(environ)
    if config.traces_endpoint is None:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OtelTracer(OTLPSpanExporter(endpoint=config.traces_endpoint), config.service_name)


class OtelTracer:
    """:class:`Tracer` on the OpenTelemetry SDK, exporting through ``exporter`` in batches
    (any SDK ``SpanExporter``: OTLP/HTTP in production, the SDK's in-memory one in a test).

    Its own ``TracerProvider``, not the process-wide one, so that two routers in one process
    (tests) keep their spans apart; the sampler is the SDK's, from ``OTEL_TRACES_SAMPLER``
    (default: parent-based, always on).
    """

    def __init__(self, exporter, service_name: str = DEFAULT_SERVICE_NAME,
                 schedule_delay_ms: float | None = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                        shutdown_on_exit=False)
        self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=schedule_delay_ms))
        self._tracer = self._provider.get_tracer("modelplane.router")
        self._propagator = TraceContextTextMapPropagator()
        self._kind, self._in_context = SpanKind.SERVER, set_span_in_context
        self._error = lambda description: Status(StatusCode.ERROR, description)

    def start(self, endpoint: str, headers: Mapping[str, str]) -> "_OtelSpan":
        parent = self._propagator.extract(headers) if headers else None
        span = self._tracer.start_span(f"router {endpoint}", context=parent, kind=self._kind,
                                       attributes={"modelplane.endpoint": endpoint})
        outgoing: dict[str, str] = {}
        self._propagator.inject(outgoing, context=self._in_context(span))
        if TRACESTATE in headers:  # the client's, as it came (the SDK would re-serialize it)
            outgoing[TRACESTATE] = headers[TRACESTATE]
        return _OtelSpan(span, outgoing, self._error)

    def close(self) -> None:
        self._provider.force_flush(timeout_millis=5_000)
        self._provider.shutdown()


class _OtelSpan:
    __slots__ = ("_span", "headers", "_error", "_ended")

    def __init__(self, span, headers: dict[str, str], error: Callable) -> None:
        self._span, self.headers, self._error, self._ended = span, headers, error, False

    def end(self, revision_id: str | None, replica_url: str | None, status: int, retries: int) -> None:
        if self._ended:
            return
        self._ended = True
        span = self._span
        if revision_id is not None:
            span.set_attribute("modelplane.revision", revision_id)
        if replica_url is not None:
            span.set_attribute("modelplane.replica.url", replica_url)
        span.set_attribute("modelplane.retries", retries)
        if status:
            span.set_attribute("http.response.status_code", status)
        if status == 0 or status >= 500:
            span.set_status(self._error("no answer" if status == 0 else f"HTTP {status}"))
        span.end()
