"""What the router served, as inference-log records (``inference_log`` in the spec).

A request is sampled when it arrives, at its endpoint's ``sample_rate``; a sampled request
becomes one record when its answer is complete (a stream: when it ends), with the revision
that answered and its role (``serve``, ``canary``; shadow copies are ``shadow``), sizes,
latency and status, and, with ``include_payloads``, both bodies cut at
``max_payload_bytes``. Records go to :class:`serving.router.inference_log.InferenceLogWriter`,
which never blocks the request: a full buffer drops and counts.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from datetime import datetime, timezone

from controlplane.inference_log import InferenceRecord
from serving.router.inference_log import InferenceLogWriter, capped
from serving.router.exchange import Exchange
from serving.router.table import EndpointRoute


class Recorder:
    def __init__(self, writer: InferenceLogWriter | None, router_id: str, rng: random.Random | None = None) -> None:
        self.writer = writer
        self.router_id = router_id
        self._rng = rng or random.Random()

    def sampled(self, route: EndpointRoute) -> bool:
        rate = route.policy.log_sample_rate
        return self.writer is not None and rate > 0 and (rate >= 1 or self._rng.random() < rate)

    def keep_bytes(self, route: EndpointRoute) -> int:
        """How much of the answer to keep for the record (0: payloads are not logged)."""
        return route.policy.log_max_payload_bytes if route.policy.log_payloads else 0

    def on_done(self, route: EndpointRoute, token_id: str | None, body: bytes, arrived: datetime,
                started: float) -> Callable[[Exchange], None]:
        """The callback that writes the record once the answer is complete."""
        keep = self.keep_bytes(route)

        def done(exchange: Exchange) -> None:
            self.writer.offer(InferenceRecord(
                at=arrived, endpoint=route.name, kind=exchange.role, status=exchange.status,
                latency_ms=round(1000 * (time.perf_counter() - started), 3), request_bytes=len(body),
                response_bytes=exchange.response_bytes, revision_id=exchange.revision_id, token_id=token_id,
                router_id=self.router_id, request_payload=capped(body, keep) if keep else None,
                response_payload=_answer(exchange, keep) if keep else None))

        return done

    def shadow(self, route: EndpointRoute, revision_id: str, status: int, latency_ms: float, body: bytes,
               response_bytes: int) -> None:
        """A shadow copy's outcome, sampled at the endpoint's rate like any request."""
        if self.sampled(route):
            self.writer.offer(InferenceRecord(
                at=datetime.now(timezone.utc), endpoint=route.name, kind="shadow", status=status,
                latency_ms=round(latency_ms, 3), request_bytes=len(body), response_bytes=response_bytes,
                revision_id=revision_id, router_id=self.router_id))


def _answer(exchange: Exchange, keep: int) -> str | None:
    """The kept head of the answer, the cut marked as ``capped`` marks it."""
    cut = exchange.response_bytes - len(exchange.response_head)
    if cut <= 0:
        return capped(exchange.response_head, keep)
    # The head holds ``keep`` bytes: one more byte makes ``capped`` cut it (never mid-character).
    head = capped(exchange.response_head + b"\0", keep).rsplit("…[truncated", 1)[0]
    return f"{head}…[truncated {cut} bytes]"
