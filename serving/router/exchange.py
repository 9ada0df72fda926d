"""What passes between the router and one replica: the record of a request, the headers a
replica is sent, and a body read up to a limit (used by :mod:`serving.router.proxy`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from serving.router.admission import Upstream

# identity: bodies are relayed as they come, so they must not come compressed
REPLICA_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}


@dataclass
class Exchange:
    """What became of one request, filled in by the proxy for the inference log."""

    revision_id: str | None = None
    role: str = "serve"
    status: int = 0
    replica_url: str | None = None  # the last replica it was sent to
    retries: int = 0  # sends to another replica after the first could not take it
    response_bytes: int = 0
    response_head: bytes = b""  # the first ``keep_bytes`` of the answer, when asked for
    keep_bytes: int = 0

    def add(self, chunk: bytes) -> None:
        self.response_bytes += len(chunk)
        if len(self.response_head) < self.keep_bytes:
            self.response_head += chunk[: self.keep_bytes - len(self.response_head)]


def replica_headers(upstream: Upstream) -> dict[str, str]:
    """What a replica is sent besides the body: its type, no compression, and the trace headers."""
    if upstream.content_type != REPLICA_HEADERS["Content-Type"]:
        return {**REPLICA_HEADERS, "Content-Type": upstream.content_type, **upstream.trace_headers}
    return {**REPLICA_HEADERS, **upstream.trace_headers} if upstream.trace_headers else REPLICA_HEADERS


def ending_span(span, on_done: Callable[[Exchange], None] | None) -> Callable[[Exchange], None]:
    """``on_done``, after ending ``span`` with what became of the request."""
    def done(exchange: Exchange) -> None:
        span.end(exchange.revision_id, exchange.replica_url, exchange.status, exchange.retries)
        if on_done is not None:
            on_done(exchange)
    return done


async def read_all(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None as soon as it grows past ``limit`` bytes."""
    chunks, size = [], 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
