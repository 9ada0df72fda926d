"""Admission by load: an endpoint's rate limits and its bounded wait queue, per router.

Rate limits (``rate_limits`` in the spec) are token buckets (:mod:`serving.router.ratelimit`),
charged before the request waits or is sent: per endpoint in requests and in model units
(the request's estimated replica milliseconds, :mod:`serving.router.cost`), per bearer token
in requests and in model units. A refusal is a 429 whose ``Retry-After`` is the exact wait,
rounded up to a whole second; a request costing more than a limit's burst is a 413.

``routing.max_concurrent_requests`` caps what the endpoint runs at once through this
router; the next ``max_queued_requests`` wait in order (429 beyond), each at most
``max_queue_wait_s`` (503 after), :mod:`serving.router.queueing`.

Limits are per router process: with N routers behind one address an endpoint admits up to
N × its rate. (Dividing by N would need the routers to agree on N; docs/router.md says so.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from controlplane.tokens import Grant
from serving.router.errors import RouterError
from serving.router.policy import RateLimit
from serving.router.queueing import ConcurrencyGate
from serving.router.ratelimit import Charge, Limiter
from serving.router.table import EndpointRoute


def charges(route: EndpointRoute, grant: Grant, units: float) -> list[Charge]:
    """The charges a request of ``units`` model units brings, one per limit the endpoint sets.

    >>> from serving.router.policy import RoutePolicy
    >>> route = EndpointRoute("gec", "vllm", "r1", (), policy=RoutePolicy(endpoint_requests=RateLimit(5, 5)))
    >>> [(c.bucket_key, c.amount) for c in charges(route, Grant("t1", frozenset(), True), 70.0)]
    [(('endpoint_requests', 'gec'), 1.0)]
    """
    policy, found = route.policy, []

    def add(limit: RateLimit | None, scope: str, key: str, amount: float) -> None:
        if limit is not None:
            found.append(Charge((scope, key), limit.rate_per_s, limit.burst, amount))

    add(policy.endpoint_requests, "endpoint_requests", route.name, 1.0)
    add(policy.endpoint_units, "endpoint_units", route.name, units)
    # A token's limits are per endpoint: a token allowed on two endpoints has a budget on each.
    add(policy.token_requests, "token_requests", f"{grant.token_id}@{route.name}", 1.0)
    add(policy.token_units, "token_units", f"{grant.token_id}@{route.name}", units)
    return found


class Gatekeeper:
    def __init__(self, monotonic: Callable[[], float] = time.monotonic, retry_after_s: int = 1) -> None:
        self._monotonic = monotonic
        self._retry_after_s = retry_after_s  # sent with the queue's 429 and 503
        self.limiter = Limiter()
        self.gates: dict[str, ConcurrencyGate] = {}

    def check_rates(self, route: EndpointRoute, grant: Grant, units: float) -> str | None:
        """Charge the request to its limits; raises the 429/413 :class:`RouterError`. Returns
        nothing on admission; the refusing limit's name is on the error for metrics."""
        if not route.policy.rate_limited:
            return None
        decision = self.limiter.admit(charges(route, grant, units), self._monotonic())
        error = decision.error()
        if error is not None:
            # the metric's label: the endpoint's limit as it reads, a token's without the token
            # (one series per token would grow without bound)
            subject, _, rate = decision.limit.partition(": ")
            error.limit = decision.limit if subject.startswith("endpoint ") else f"per token: {rate}"
            raise error
        return None

    def gate(self, route: EndpointRoute) -> ConcurrencyGate | None:
        """The endpoint's wait queue, following its policy; None without a concurrency limit."""
        policy = route.policy
        if policy.max_concurrent_requests is None:
            self.gates.pop(route.name, None)
            return None
        gate = self.gates.get(route.name)
        if gate is None:
            gate = self.gates[route.name] = ConcurrencyGate(policy.max_concurrent_requests,
                                                            policy.max_queued_requests, policy.max_queue_wait_s,
                                                            name=f"endpoint {route.name!r}",
                                                            retry_after_s=self._retry_after_s)
        else:
            gate.update(policy.max_concurrent_requests, policy.max_queued_requests, policy.max_queue_wait_s)
        return gate


async def acquire_unless_gone(gate: ConcurrencyGate, request) -> None:
    """Wait for a slot of ``gate``, but not for a client that went away meanwhile: its place in
    the queue goes to the next (Starlette does not cancel a handler whose client left).
    ``request`` is the Starlette request: its ``receive()`` says when the client disconnects."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    acquiring, leaving = asyncio.ensure_future(gate.acquire()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({acquiring, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        leaving.cancel()
        if not acquiring.done():
            acquiring.cancel()
            await asyncio.gather(acquiring, return_exceptions=True)  # let the gate see it leave
    if acquiring.cancelled():
        raise RouterError(499, "the client closed the connection while its request waited for a slot")
    acquiring.result()  # a slot, or the queue's 429/503
