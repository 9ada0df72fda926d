"""Scale from zero: hold a request for an endpoint with no ready replica until one is ready.

An endpoint whose serving revision has no ready replica (scaled to zero, or its replicas
restarting) does not answer 503 at once: the request waits here, counted in
``waiting_requests`` of ``/internal/in-flight`` — the autoscaler orders a replica as soon
as it sees one waiting (``autoscale.horizontal``, rule ``from-zero``) — while the router
re-checks its routing table. It is sent when a replica is ready; past its deadline it gets
503 with ``Retry-After``; when ``max_waiting`` requests already wait for the endpoint, 503
at once (the queue is bounded).

The deadline is sized from the revision's measured cold start (``cold_start_s``, recorded by
``served_endpoint``): ``hold_cold_start_factor × cold start + hold_margin_s``, within
``[hold_min_s, hold_max_s]``. Worked example: a pyfunc revision that took 4 s to become
ready, factor 2, margin 5 s → 13 s; a vLLM one that took 90 s → 185 s, capped at 180 s.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable

from serving.router.errors import RouterError
from serving.router.table import EndpointRoute


def hold_deadline_s(cold_start_s: float | None, factor: float, margin_s: float, low_s: float, high_s: float) -> float:
    """How long a request may wait for a replica (see the module docstring).

    >>> hold_deadline_s(4.0, 2.0, 5.0, 10.0, 180.0)
    13.0
    >>> hold_deadline_s(90.0, 2.0, 5.0, 10.0, 180.0)
    180.0
    >>> hold_deadline_s(None, 2.0, 5.0, 10.0, 180.0)  # never measured: the longest wait
    180.0
    """
    if cold_start_s is None:
        return high_s
    return min(max(factor * cold_start_s + margin_s, low_s), high_s)


class Activator:
    def __init__(self, *, max_waiting: int, factor: float, margin_s: float, low_s: float, high_s: float,
                 poll_s: float, retry_after_s: int) -> None:
        self.waiting: dict[str, int] = defaultdict(int)
        self._max_waiting, self._factor, self._margin_s = max_waiting, factor, margin_s
        self._low_s, self._high_s, self._poll_s, self._retry_after_s = low_s, high_s, poll_s, retry_after_s

    async def ready_route(self, route: EndpointRoute, current: Callable[[], EndpointRoute | None]) -> EndpointRoute:
        """``route`` if it has ready replicas, else the same endpoint's route once it has; RouterError 503 past
        the deadline or with the queue full."""
        if route.replicas:
            return route
        name = route.name
        if self.waiting[name] >= self._max_waiting:
            raise RouterError(503, f"endpoint {name!r} has no ready replica and {self._max_waiting} requests already "
                                   "wait for one; retry shortly", {"Retry-After": str(self._retry_after_s)})
        deadline_s = hold_deadline_s(route.cold_start_s, self._factor, self._margin_s, self._low_s, self._high_s)
        give_up = time.monotonic() + deadline_s
        self.waiting[name] += 1
        try:
            while time.monotonic() < give_up:
                await asyncio.sleep(self._poll_s)
                now = current()
                if now is None or now.revision_id is None:
                    raise RouterError(503, f"endpoint {name!r} stopped serving while this request waited; retry "
                                           "shortly", {"Retry-After": str(self._retry_after_s)})
                if now.replicas:
                    return now
        finally:
            self.waiting[name] -= 1
            if not self.waiting[name]:
                del self.waiting[name]
        raise RouterError(503, f"endpoint {name!r} had no ready replica within {deadline_s:g} s (its measured cold "
                               "start allows that long); retry shortly", {"Retry-After": str(self._retry_after_s)})
