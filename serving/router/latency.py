"""Answers per endpoint over a recent window: the vertical autoscaler's p99, the health check's errors.

The router times every answer to a known endpoint (authentication to the answer's headers;
for a stream that is its time to first byte). ``summary`` gives, per endpoint, over the last
``window_s``: how many answers, how many were errors of the revision (server errors, 5xx, the
platform's fault, not the client's; and 400s where the model raised on input that passed its
signature, which the replica marks: :mod:`serving.blame`), and the p99 latency of the
successful ones, for the endpoint and for each
revision that answered (a health check judges a new revision on its own answers, not on
those of the one it replaced). Memory is bounded: at most
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

    def observe(self, endpoint: str, latency_ms: float, now_s: float, status: int = 200,
                revision_id: str | None = None, model_fault: bool = False) -> None:
        """``model_fault``: a 4xx the replica marked as the model's (it counts as an error)."""
        self._samples[endpoint].append((now_s, latency_ms, status, revision_id, status >= 500 or model_fault))

    def summary(self, now_s: float) -> dict[str, dict]:
        """``{endpoint: {"p99_latency_ms": …, "requests": n, "errors": m, "revisions": {id: {same}}}}`` for the
        endpoints answered within the window (p99 None when none succeeded).

        >>> window = LatencyWindow(window_s=30.0)
        >>> for at_s, ms, status, rev in ((0.0, 900.0, 200, "v1"), (10.0, 100.0, 200, "v1"), (20.0, 5.0, 503, "v2"),
        ...                               (21.0, 7.0, 400, "v2")):
        ...     window.observe("gec", ms, at_s, status, rev)
        >>> summary = window.summary(now_s=35.0)["gec"]  # the answer at 0 s is out of the window
        >>> summary["p99_latency_ms"], summary["requests"], summary["errors"], summary["revisions"]["v2"]
        (100.0, 3, 1, {'p99_latency_ms': None, 'requests': 2, 'errors': 1})
        >>> window.observe("gec", 6.0, 22.0, 400, "v2", model_fault=True)  # the model raised on valid input
        >>> window.summary(now_s=35.0)["gec"]["revisions"]["v2"]["errors"]
        2
        """
        result = {}
        for endpoint in list(self._samples):
            samples = self._samples[endpoint]
            while samples and samples[0][0] < now_s - self.window_s:
                samples.popleft()
            if not samples:
                del self._samples[endpoint]
                continue
            revisions = {}
            for revision_id in sorted({s[3] for s in samples if s[3] is not None}):
                revisions[revision_id] = _stats([s for s in samples if s[3] == revision_id])
            result[endpoint] = {**_stats(samples), "revisions": revisions}
        return result


def _stats(samples) -> dict:
    ok = [latency for _, latency, status, _, _ in samples if 200 <= status < 300]
    return {"p99_latency_ms": round(p99(ok), 3) if ok else None, "requests": len(samples),
            "errors": sum(1 for *_, blamed in samples if blamed)}
