"""Answer latency per endpoint over a recent window: the vertical autoscaler's p99 signal.

The router times every answered request (authentication to the answer's headers; for a
stream that is its time to first byte). ``summary`` gives, per endpoint, the p99 of the
answers of the last ``window_s`` and how many there were. Memory is bounded: at most
``max_samples`` per endpoint (the newest kept), older than ``window_s`` dropped.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile.

    >>> p99([float(v) for v in range(1, 101)])
    99.0
    >>> p99([5.0])
    5.0
    """
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class LatencyWindow:
    def __init__(self, window_s: float = 30.0, max_samples: int = 20_000) -> None:
        self.window_s = window_s
        self._samples: dict[str, deque] = defaultdict(lambda: deque(maxlen=max_samples))

    def observe(self, endpoint: str, latency_ms: float, now_s: float) -> None:
        self._samples[endpoint].append((now_s, latency_ms))

    def summary(self, now_s: float) -> dict[str, dict]:
        """``{endpoint: {"p99_latency_ms": …, "requests": n}}`` for endpoints answered within the window."""
        result = {}
        for endpoint in list(self._samples):
            samples = self._samples[endpoint]
            while samples and samples[0][0] < now_s - self.window_s:
                samples.popleft()
            if not samples:
                del self._samples[endpoint]
                continue
            result[endpoint] = {"p99_latency_ms": round(p99([latency for _, latency in samples]), 3),
                                "requests": len(samples)}
        return result
