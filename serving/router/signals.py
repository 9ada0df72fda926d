"""Work in flight at this router, per endpoint and replica, in 1-second buckets over the last minute.

The autoscaler's primary signal (``docs/router.md``, "Signals"): the router counts what it
sends, so the controller reads in-flight work with no scrape lag. The proxy reports every
change (a request sent to a replica, a request finished there); each change is O(1) and
no lock is needed, as the router runs on one event loop. Nothing here reads a clock:
every call takes ``now_s``.

For every endpoint, and every replica URL of it, the window keeps the current number of
requests and model units in flight and, for each second, the **most** requests and units
in flight at any moment of that second and how many requests **started** in it. A second
with no change repeats the level that held through it, so a 40-second generation shows 1
in flight in all 40 buckets, not only in the two where it started and ended.

Bucket keys are wall-clock UNIX seconds (``time.time()``), not ``time.monotonic()``:
each router process's monotonic clock counts from an arbitrary origin of its own, so only
wall time lets the controller line up the buckets of several routers, on several
machines, by second. Wall time can step backwards (an NTP correction); a change that
arrives with a second older than the newest bucket is counted in the newest bucket, so
buckets stay in order and are never rewritten in the past.

:meth:`InFlightWindow.snapshot` is what ``GET /internal/in-flight`` answers, e.g. one
request on each of gec's two replicas, the second sent at 12:00:07 (buckets cut to three)::

    {"router_id": "node-a:8080:4242", "now_s": 1800000007.5, "bucket_s": 1, "window_s": 60,
     "endpoints": {"gec": {
         "in_flight_requests": 2, "in_flight_units": 3.5, "waiting_requests": 0,
         "buckets": [{"at_s": 1800000005, "in_flight_requests": 1, "in_flight_units": 1.5, "started": 0},
                     {"at_s": 1800000006, "in_flight_requests": 1, "in_flight_units": 1.5, "started": 0},
                     {"at_s": 1800000007, "in_flight_requests": 2, "in_flight_units": 3.5, "started": 1}],
         "replicas": {
             "http://10.0.0.5:9000": {"in_flight_requests": 1, "in_flight_units": 1.5},
             "http://10.0.0.6:9000": {"in_flight_requests": 1, "in_flight_units": 2.0}}}}}

- ``buckets``: one per second, oldest first, from ``floor(now_s) - 59`` (or ``since_s``,
  if later) to ``floor(now_s)``. The last one is still open: its maxima may yet grow.
- Each replica has ``buckets`` of its own (same form) only when asked for
  (``replica_buckets``): with 50 replicas they make the answer ten times larger (about
  300 kB and 5 ms of the router's event loop, against 30 kB and 0.5 ms), and the
  horizontal policy needs only the endpoint's.
- An endpoint's ``started`` counts requests; a replica's counts requests sent to it, so a
  request refused by one replica's socket and sent to another counts once for the
  endpoint and once on each replica.
- ``waiting_requests``: requests held because the endpoint has no ready replica. The router
  answers 503 at once today, so it is 0 until it holds requests for scale from zero.

The controller sums routers second by second: for each endpoint and each ``at_s``, add the
routers' ``in_flight_requests`` (a router without that second, or without the endpoint,
adds 0). Maxima taken apart add up to at least the true peak of the sum, never less, as
two routers' peaks within a second need not coincide: a sum can only scale up too early,
never too late.

Memory is bounded: at most 61 buckets per series (older ones are dropped as new seconds
open), and :meth:`InFlightWindow.retain` drops endpoints and replicas that left the routing
table once nothing is in flight on them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping

WINDOW_S = 60
BUCKET_S = 1

# A bucket: [second, max requests, max units, started, requests when it opened, units when it opened].
# Lists, not objects: the proxy updates one on every request, and the open levels fill the
# seconds before it in which nothing changed.
_AT, _MAX_REQUESTS, _MAX_UNITS, _STARTED, _OPEN_REQUESTS, _OPEN_UNITS = range(6)


class _Series:
    """The in-flight level of one endpoint or replica, and its buckets of the last minute."""

    __slots__ = ("requests", "units", "buckets")

    def __init__(self) -> None:
        self.requests = 0
        self.units = 0.0
        self.buckets: deque[list] = deque()

    def change(self, requests: int, units: float, started: int, second: int) -> None:
        buckets = self.buckets
        bucket = buckets[-1] if buckets else None
        if bucket is None or second > bucket[_AT]:
            bucket = [second, self.requests, self.units, 0, self.requests, self.units]
            buckets.append(bucket)
            while buckets[0][_AT] <= second - WINDOW_S:
                buckets.popleft()
        self.requests += requests
        # With nothing in flight there are no units in flight: no float residue from +x - x.
        self.units = self.units + units if self.requests else 0.0
        if self.requests > bucket[_MAX_REQUESTS]:
            bucket[_MAX_REQUESTS] = self.requests
        if self.units > bucket[_MAX_UNITS]:
            bucket[_MAX_UNITS] = self.units
        bucket[_STARTED] += started

    def idle(self) -> bool:
        return self.requests == 0

    def dense(self, first: int, last: int) -> list[dict]:
        """One bucket per second from ``first`` to ``last``; a second without a change holds the
        level that held through it: the level the next bucket opened with, or the current one."""
        stored = {bucket[_AT]: bucket for bucket in self.buckets if bucket[_AT] >= first}
        requests, units = self.requests, self.units
        out = []
        for second in range(last, first - 1, -1):
            bucket = stored.get(second)
            if bucket is None:
                out.append({"at_s": second, "in_flight_requests": requests, "in_flight_units": units, "started": 0})
            else:
                out.append({"at_s": second, "in_flight_requests": bucket[_MAX_REQUESTS],
                            "in_flight_units": bucket[_MAX_UNITS], "started": bucket[_STARTED]})
                requests, units = bucket[_OPEN_REQUESTS], bucket[_OPEN_UNITS]
        out.reverse()
        return out


class _Endpoint:
    __slots__ = ("total", "replicas", "waiting_requests")

    def __init__(self) -> None:
        self.total = _Series()
        self.replicas: dict[str, _Series] = {}
        # Requests held for want of a ready replica. Always 0 until the router holds requests
        # for scale from zero; the hold queue will count them here.
        self.waiting_requests = 0


class InFlightWindow:
    """Requests and model units in flight per endpoint and replica, by second, for the last minute.

    >>> window = InFlightWindow("node-a:8080")
    >>> window.started("gec", "http://r0", 1.5, now_s=100.2)
    >>> window.started("gec", "http://r1", 2.0, now_s=100.7)
    >>> window.ended("gec", "http://r0", 1.5, now_s=101.1)
    >>> gec = window.snapshot(now_s=101.9, since_s=100)["endpoints"]["gec"]
    >>> gec["in_flight_requests"], gec["in_flight_units"]
    (1, 2.0)
    >>> [(b["at_s"], b["in_flight_requests"], b["in_flight_units"], b["started"]) for b in gec["buckets"]]
    [(100, 2, 3.5, 2), (101, 2, 3.5, 0)]
    """

    def __init__(self, router_id: str) -> None:
        self.router_id = router_id
        self._endpoints: dict[str, _Endpoint] = {}

    def started(self, endpoint: str, replica_url: str, units: float, now_s: float, *, retry: bool = False) -> None:
        """A request of ``units`` model units was sent to ``replica_url``.

        ``retry``: the same request, sent on after another replica refused the connection; it
        counts as started on this replica but not again for the endpoint."""
        second = math.floor(now_s)
        record = self._endpoints.get(endpoint)
        if record is None:
            record = self._endpoints[endpoint] = _Endpoint()
        replica = record.replicas.get(replica_url)
        if replica is None:
            replica = record.replicas[replica_url] = _Series()
        record.total.change(1, units, 0 if retry else 1, second)
        replica.change(1, units, 1, second)

    def ended(self, endpoint: str, replica_url: str, units: float, now_s: float) -> None:
        """The request :meth:`started` on ``replica_url`` is over (answered, failed, or never sent)."""
        second = math.floor(now_s)
        record = self._endpoints.get(endpoint)
        replica = record.replicas.get(replica_url) if record is not None else None
        if replica is None or replica.idle():  # nothing started there: a caller's mistake must not go negative
            return
        record.total.change(-1, -units, 0, second)
        replica.change(-1, -units, 0, second)

    def retain(self, replicas_by_endpoint: Mapping[str, Iterable[str]]) -> None:
        """Follow the routing table: list its endpoints and replicas (with 0 in flight if idle) and
        drop those that left it once nothing is in flight on them. Called on every table refresh."""
        for endpoint, urls in replicas_by_endpoint.items():
            record = self._endpoints.get(endpoint)
            if record is None:
                record = self._endpoints[endpoint] = _Endpoint()
            for url in urls:
                if url not in record.replicas:
                    record.replicas[url] = _Series()
        for endpoint, record in list(self._endpoints.items()):
            current = set(replicas_by_endpoint.get(endpoint, ()))
            for url, series in list(record.replicas.items()):
                if url not in current and series.idle():
                    del record.replicas[url]
            if endpoint not in replicas_by_endpoint and record.total.idle() and not record.waiting_requests:
                del self._endpoints[endpoint]

    def snapshot(self, now_s: float, since_s: int | None = None, replica_buckets: bool = False) -> dict:
        """The JSON-able state at ``now_s``: current levels and the buckets of the last minute
        (only those at or after ``since_s``, if given; each replica's too with ``replica_buckets``).
        The shape is in the module docstring."""
        last = math.floor(now_s)
        first = last - WINDOW_S + 1 if since_s is None else max(last - WINDOW_S + 1, since_s)
        endpoints = {}
        for name, record in sorted(self._endpoints.items()):
            endpoints[name] = {
                "in_flight_requests": record.total.requests,
                "in_flight_units": record.total.units,
                "waiting_requests": record.waiting_requests,
                "buckets": record.total.dense(first, last),
                "replicas": {url: {"in_flight_requests": series.requests, "in_flight_units": series.units}
                             for url, series in sorted(record.replicas.items())},
            }
            if replica_buckets:
                for url, series in record.replicas.items():
                    endpoints[name]["replicas"][url]["buckets"] = series.dense(first, last)
        return {"router_id": self.router_id, "now_s": now_s, "bucket_s": BUCKET_S, "window_s": WINDOW_S,
                "endpoints": endpoints}
