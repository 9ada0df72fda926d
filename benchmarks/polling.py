"""Waiting for something to become true: shared by the benchmarks' harnesses and the tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from serving.tls import tls_context


def poll_intervals_s(first_s: float, max_s: float = 1.0, growth: float = 1.5) -> Iterator[float]:
    """The pauses between polls: ``first_s``, then 1.5 times longer each time, up to ``max_s``
    (never below ``first_s``). A condition that comes true at once is seen at once; one that
    takes minutes (a Dagster run, a vLLM start) is asked about once a second, not five times.

    >>> from itertools import islice
    >>> list(islice(poll_intervals_s(0.2), 7))
    [0.2, 0.3, 0.45, 0.675, 1.0, 1.0, 1.0]
    >>> list(islice(poll_intervals_s(2.0), 2))
    [2.0, 2.0]
    """
    interval_s, cap_s = first_s, max(first_s, max_s)
    while True:
        yield round(interval_s, 6)
        interval_s = min(cap_s, interval_s * growth)


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.2,
             max_interval_s: float = 1.0):
    """Poll ``predicate`` until it returns something truthy (returned), or fail naming ``what``.

    The pauses start at ``interval_s`` and grow to ``max_interval_s`` (:func:`poll_intervals_s`).
    """
    deadline = time.monotonic() + timeout_s
    pauses = poll_intervals_s(interval_s, max_interval_s)
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(min(next(pauses), max(0.0, deadline - time.monotonic())))
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def answers_ok(url: str, timeout_s: float = 5.0, **request) -> bool:
    """Whether ``url`` answers 200 now; False, not an error, while nothing listens there yet (a
    restarted service that has not bound its port) or the connection fails."""
    import httpx

    try:
        return httpx.get(url, timeout=timeout_s, verify=tls_context(), **request).status_code == 200
    except httpx.TransportError:
        return False
