"""The scoring server's Prometheus metrics, correct across worker processes.

With one worker the metrics live in a private registry of the process. With several worker
processes, the supervisor sets ``PROMETHEUS_MULTIPROC_DIR`` to a directory of its own (one per
replica, emptied at start) before it starts them, so prometheus_client keeps every value in
memory-mapped files there, and ``/metrics``, whichever worker answers it, merges all files:
counters and histograms are summed over every process that ever ran (monotonic across a
worker restart), the two gauges are ``livesum`` (summed over live processes; the supervisor
calls ``mark_process_dead`` for a worker that exits).

``modelplane_pyfunc_requests_completed_total`` counts requests whose predict call finished
(answer or model error): the forward-progress signal. Requests rejected before the queue
(400, 413, 415) count in ``requests_total`` only, so a hung predict thread cannot hide behind a
stream of rejected requests.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

PREFIX = "modelplane_pyfunc"
COMPLETED = f"{PREFIX}_requests_completed"
IN_FLIGHT = f"{PREFIX}_requests_in_flight"
QUEUE_DEPTH = f"{PREFIX}_queue_depth"
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def multiprocess_dir() -> str | None:
    """The shared metrics directory when several worker processes serve this replica."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class ServerMetrics:
    """Every metric one server process records. ``registry=None`` in multiprocess mode, where
    the values go to the shared directory and :meth:`render` reads them from there."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self._registry = registry
        self._requests = Counter(f"{PREFIX}_requests", "HTTP requests to /invocations by status code", ["code"],
                                 registry=registry)
        self._latency = Histogram(f"{PREFIX}_request_latency_seconds",
                                  "Time from request start to response, /invocations", buckets=LATENCY_BUCKETS_S,
                                  registry=registry)
        self._in_flight = Gauge(IN_FLIGHT, "/invocations requests being worked on now", registry=registry,
                                multiprocess_mode="livesum")
        self._queue_depth = Gauge(QUEUE_DEPTH, "Requests parsed and waiting for a predict call",
                                  registry=registry, multiprocess_mode="livesum")
        self._batch_requests = Histogram(f"{PREFIX}_batch_size_requests", "Requests per predict call",
                                         buckets=BATCH_BUCKETS, registry=registry)
        self._batch_rows = Histogram(f"{PREFIX}_batch_size_rows", "Rows per predict call", buckets=BATCH_BUCKETS,
                                     registry=registry)
        self._completed = Counter(COMPLETED, "Requests whose predict call finished (forward progress)",
                                  registry=registry)
        self._by_code: dict[int, Counter] = {}

    @classmethod
    def for_this_process(cls) -> ServerMetrics:
        if multiprocess_dir():
            return cls(None)
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)  # process_cpu_seconds_total etc. (not available in multiprocess mode)
        return cls(registry)

    def request_started(self) -> None:
        self._in_flight.inc()

    def request_finished(self, status: int, duration_s: float) -> None:
        counter = self._by_code.get(status)
        if counter is None:
            counter = self._by_code[status] = self._requests.labels(code=str(status))
        counter.inc()
        self._latency.observe(duration_s)
        self._in_flight.dec()

    def queue_depth(self, requests: int) -> None:
        self._queue_depth.set(requests)

    def batch_done(self, requests: int, rows: int) -> None:
        self._batch_requests.observe(requests)
        self._batch_rows.observe(rows)
        self._completed.inc(requests)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition: (body, content type)."""
        directory = multiprocess_dir()
        if directory:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=directory)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self._registry), CONTENT_TYPE_LATEST
