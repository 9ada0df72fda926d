"""Waiting for something to become true: shared by the benchmarks' harnesses and the tests."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.2):
    """Poll ``predicate`` until it returns something truthy (returned), or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def answers_ok(url: str, timeout_s: float = 5.0, **request) -> bool:
    """Whether ``url`` answers 200 now; False, not an error, while nothing listens there yet (a
    restarted service that has not bound its port) or the connection fails."""
    import httpx

    try:
        return httpx.get(url, timeout=timeout_s, **request).status_code == 200
    except httpx.TransportError:
        return False
