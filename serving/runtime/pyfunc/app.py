"""The scoring server as a raw ASGI application: no framework on the hot path.

Routes: ``POST /invocations`` (MLflow's protocol), ``GET /health`` and ``GET /ping`` (200 once
the model is loaded in every worker of the replica, 503 before), ``GET /metrics``
(Prometheus), ``GET /version`` (the MLflow version, as MLflow's server answers). The model loads in the predict thread after startup, so the
server answers ``/health`` with 503 while it loads.

Each route only parses, calls the pure or injected piece, and writes the answer; errors are
:class:`~.responses.Outcome` values.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, MutableSequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from importlib.metadata import version
from pathlib import Path

from serving.blame import FAULT_HEADER, MODEL_FAULT
from serving.runtime.pyfunc.batcher import MicroBatcher
from serving.runtime.pyfunc.batching import BatchPolicy
from serving.runtime.pyfunc.config import PyfuncServerConfig
from serving.runtime.pyfunc.metrics import ServerMetrics
from serving.runtime.pyfunc.payload import InvocationError, check_content_type, parse_invocation
from serving.runtime.pyfunc.responses import Outcome, error_outcome, text_outcome

logger = logging.getLogger(__name__)
HEALTHY = Outcome(200, b'{"status":"ok"}')
LOADING = error_outcome(503, "The model is still loading; retry shortly.")


class Readiness:
    """Whether every worker process of the replica has loaded its model.

    ``flags`` is shared memory with one byte per worker (``multiprocessing.Array``), or None for a
    single-process server.
    """

    def __init__(self, flags: MutableSequence[int] | None = None, slot: int = 0) -> None:
        self._flags, self._slot, self._loaded = flags, slot, False

    def mark_loaded(self) -> None:
        self._loaded = True
        if self._flags is not None:
            self._flags[self._slot] = 1

    @property
    def this_worker(self) -> bool:
        return self._loaded

    @property
    def replica(self) -> bool:
        return self._loaded and (self._flags is None or all(self._flags))


class PyfuncApp:
    """ASGI callable. ``load_predictor`` runs in the predict thread and returns the predictor;
    ``on_fatal`` is called (on the event loop) when it fails."""

    def __init__(self, config: PyfuncServerConfig, metrics: ServerMetrics, readiness: Readiness,
                 load_predictor: Callable[[Path], object], on_fatal: Callable[[BaseException], None]) -> None:
        self.config = config
        self.metrics = metrics
        self.readiness = readiness
        self.load_predictor = load_predictor
        self.on_fatal = on_fatal
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predict")
        self.batcher = MicroBatcher(BatchPolicy(config.max_batch_rows, config.max_batch_wait_ms), metrics,
                                    self.executor)
        self.concatenate_frames = True
        self._tasks: list[asyncio.Task] = []

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if path == "/invocations":
                await self._invocations(scope, receive, send)
            elif path in ("/health", "/ping"):
                await _respond(send, HEALTHY if self.readiness.replica else LOADING)
            elif path == "/metrics":
                body, content_type = self.metrics.render()
                await _respond(send, Outcome(200, body, content_type.encode()))
            elif path == "/version":
                await _respond(send, Outcome(200, _mlflow_version()))
            else:
                await _respond(send, error_outcome(404, f"No route {path}: use POST /invocations."))
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._tasks = [asyncio.create_task(self.batcher.run(), name="batcher"),
                               asyncio.create_task(self._load(), name="load-model")]
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for task in self._tasks:
                    task.cancel()
                self.executor.shutdown(wait=False, cancel_futures=True)
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _load(self) -> None:
        started = time.perf_counter()
        try:
            predictor = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.load_predictor, self.config.model_dir)
        except Exception as exc:  # noqa: BLE001 - any load failure ends this worker
            logger.exception("could not load the model from %s", self.config.model_dir)
            self.on_fatal(exc)
            return
        self.concatenate_frames = predictor.concatenates_frames
        self.batcher.run_batch = predictor.predict_batch
        # MLflow, pandas and the model leave ~400k long-lived objects; a full collection over
        # them pauses the server ~170 ms (a p99 spike). Frozen, collections skip them.
        gc.collect()
        gc.freeze()
        self.readiness.mark_loaded()
        logger.info("model loaded from %s in %.1f s", self.config.model_dir, time.perf_counter() - started)

    async def _invocations(self, scope, receive, send) -> None:
        started = time.perf_counter()
        self.metrics.request_started()
        status = 500
        try:
            outcome = await self._score(scope, receive)
            status = outcome.status
            await _respond(send, outcome)
        finally:
            self.metrics.request_finished(status, time.perf_counter() - started)

    async def _score(self, scope, receive) -> Outcome:
        if scope["method"] != "POST":
            return error_outcome(405, f"{scope['method']} /invocations is not allowed: use POST.")
        if not self.readiness.this_worker:
            return LOADING
        content_type = content_length = None
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value.decode("latin-1")
            elif name == b"content-length":
                content_length = value
        limit = self.config.max_body_bytes
        try:
            body_format = check_content_type(content_type)
            if content_length is not None and content_length.isdigit() and int(content_length) > limit:
                raise InvocationError(413, _too_large(int(content_length), limit))
        except InvocationError as exc:
            return _error(exc)
        self.batcher.arrival_started()
        try:
            body = await _read_body(receive, limit)
            invocation = parse_invocation(body, concatenate_frames=self.concatenate_frames, body_format=body_format)
        except InvocationError as exc:
            self.batcher.arrival_abandoned()
            return _error(exc)
        except BaseException:
            self.batcher.arrival_abandoned()
            raise
        return await self.batcher.submit(invocation)


@cache
def _mlflow_version() -> bytes:
    return version("mlflow").encode()


def _error(exc: InvocationError) -> Outcome:
    return text_outcome(exc.status, exc.message) if exc.plain_text else error_outcome(exc.status, exc.message,
                                                                                      exc.error_code)


def _too_large(size: int | None, limit: int) -> str:
    actual = f"is {size} bytes, over" if size is not None else "exceeds"
    return (f"The body {actual} this server's limit of {limit} bytes: send fewer rows per request "
            f"(or raise the server's --max-body-bytes).")


async def _read_body(receive, limit: int) -> bytes:
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise InvocationError(413, _too_large(len(body), limit))
        return body
    chunks, size = [body], len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InvocationError(400, "The client disconnected before sending the whole body.")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise InvocationError(413, _too_large(None, limit))
        chunks.append(chunk)
    return b"".join(chunks)


async def _respond(send, outcome: Outcome) -> None:
    headers = [(b"content-type", outcome.content_type), (b"content-length", str(len(outcome.body)).encode())]
    if outcome.status == 503:
        headers.append((b"retry-after", b"1"))
    elif outcome.status == 413:
        headers.append((b"connection", b"close"))  # the rest of the body is never read
    if outcome.model_fault:
        headers.append((FAULT_HEADER.encode(), MODEL_FAULT.encode()))
    await send({"type": "http.response.start", "status": outcome.status, "headers": headers})
    await send({"type": "http.response.body", "body": outcome.body})
