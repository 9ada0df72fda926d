"""Outlier ejection: take a replica out of rotation after consecutive failures (pure: ``now`` is passed in).

Envoy's consecutive-5xx detection, with its defaults (``config.cluster.v3.OutlierDetection``,
https://www.envoyproxy.io/docs/envoy/latest/api-v3/config/cluster/v3/outlier_detection.proto and
https://www.envoyproxy.io/docs/envoy/latest/intro/arch_overview/upstream/outlier):

- **consecutive_failures = 5** (Envoy ``consecutive_5xx``): a failure is a 5xx answer or a failed
  connect; a success resets the count. The Nth consecutive failure ejects the replica and resets
  the count, ejected or not (as Envoy does), so a refused ejection is retried N failures later.
  Failures reported while the replica is ejected (requests sent before) are not counted.
- **base_ejection_s = 30** (``base_ejection_time``): the k-th ejection lasts ``base × k`` s, at
  most ``max_ejection_s = 300`` (``max_ejection_time``); k stops growing once ``base × k``
  reaches that cap. The replica returns exactly then (Envoy's sweep returns it at the first
  ``interval`` tick after; here time is measured, not ticked).
- **interval_s = 10** (``interval``): k comes down by one for every full ``interval_s`` the replica
  spends back in rotation without being ejected again.
- **max_ejected_percent = 10** (``max_ejection_percent``): of an endpoint's n replicas at most
  ``floor(pct × n / 100)`` are ejected at once, but at least 1 when n ≥ 2 (Envoy's documented
  behaviour, "will eject at least one host regardless of the value"; newer Envoy makes it the
  opt-in ``always_eject_one_host``), and never all n: ``allowed(n) = min(n − 1, max(1, floor(…)))``.

One detector per endpoint. Membership comes with each failure: ``failure(url, replicas, now)``
is given the replicas the request was choosing among (the serving revision's, or the canary's),
and the bound is checked against them. ``forget_absent(urls)`` drops replicas that left.

Worked example: 10 replicas (10 % → 1 may be out). ``a`` fails 5 times at t = 0 and is ejected
for 30 s; ``b`` then fails 5 times but stays in (the bound); ``a`` returns at t = 30.

>>> detector, replicas = OutlierDetector(EjectionConfig()), tuple("abcdefghij")
>>> [detector.failure("a", replicas, now=0.0) for _ in range(5)]
[False, False, False, False, True]
>>> [detector.failure("b", replicas, now=1.0) for _ in range(5)], sorted(detector.ejected(29.9))
([False, False, False, False, False], ['a'])
>>> detector.ejected(30.0)
frozenset()
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EjectionConfig:
    consecutive_failures: int = 5  # Envoy consecutive_5xx
    interval_s: float = 10.0  # Envoy interval: each one back in rotation takes one ejection off the multiplier
    base_ejection_s: float = 30.0  # Envoy base_ejection_time: the k-th ejection lasts base × k
    max_ejected_percent: float = 10.0  # Envoy max_ejection_percent, of the endpoint's replicas
    max_ejection_s: float = 300.0  # Envoy max_ejection_time: no ejection lasts longer


def allowed_ejections(replica_count: int, max_ejected_percent: float) -> int:
    """How many of ``replica_count`` replicas may be ejected at once.

    >>> [allowed_ejections(n, 10.0) for n in (0, 1, 2, 10, 19, 20, 35)]
    [0, 0, 1, 1, 1, 2, 3]
    >>> [allowed_ejections(n, 100.0) for n in (1, 2, 5)]  # never all
    [0, 1, 4]
    """
    if replica_count < 2:
        return 0
    return min(replica_count - 1, max(1, math.floor(max_ejected_percent * replica_count / 100 + 1e-9)))


@dataclass
class ReplicaOutlierState:
    consecutive_failures: int = 0
    times_ejected: int = 0  # the ejection multiplier k, as of back_since_s when not ejected
    ejected_until_s: float | None = None
    back_since_s: float = 0.0  # when it last returned: k decays from here


class OutlierDetector:
    """Consecutive-failure ejection for one endpoint's replicas; see the module docstring."""

    def __init__(self, config: EjectionConfig) -> None:
        self.config = config
        self._states: dict[str, ReplicaOutlierState] = {}
        self._ejected: frozenset[str] = frozenset()
        self._next_return_s = math.inf  # earliest ejected_until_s: before it, ejected() is a lookup

    def times_ejected(self, url: str, now: float) -> int:
        """The multiplier the replica's next ejection would start from (its current one if ejected)."""
        state = self._states.get(url)
        if state is None:
            return 0
        if state.ejected_until_s is not None:
            return state.times_ejected
        return max(0, state.times_ejected - math.floor((now - state.back_since_s) / self.config.interval_s))

    def ejected(self, now: float) -> frozenset[str]:
        """Replicas out of rotation at ``now``; those whose time is up return first."""
        if now >= self._next_return_s:
            for url in self._ejected:
                state = self._states[url]
                if state.ejected_until_s <= now:
                    state.back_since_s, state.ejected_until_s = state.ejected_until_s, None
            self._refresh()
        return self._ejected

    def success(self, url: str, now: float) -> None:
        """An answer below 500: the consecutive count starts again."""
        state = self._states.get(url)
        if state is None:
            return
        state.consecutive_failures = 0
        if url not in self.ejected(now) and self.times_ejected(url, now) == 0:
            del self._states[url]  # nothing left to remember: a healthy replica costs no memory

    def failure(self, url: str, replicas: Sequence[str], now: float) -> bool:
        """A 5xx answer or a failed connect; True when it ejected the replica. ``replicas``: the
        replicas the request chose among, which the ejection bound applies to."""
        if url in self.ejected(now):
            return False
        state = self._states.setdefault(url, ReplicaOutlierState())
        state.consecutive_failures += 1
        if state.consecutive_failures < self.config.consecutive_failures:
            return False
        state.consecutive_failures = 0
        members = set(replicas) | {url}
        if len(members & self._ejected) >= allowed_ejections(len(members), self.config.max_ejected_percent):
            return False
        times = self.times_ejected(url, now)
        base_s, cap_s = self.config.base_ejection_s, self.config.max_ejection_s
        state.times_ejected = times + 1 if base_s * times < cap_s else times
        state.ejected_until_s = now + min(base_s * state.times_ejected, cap_s)
        self._refresh()
        return True

    def forget_absent(self, urls: Iterable[str]) -> None:
        """Drop what is known of replicas not in ``urls`` (they left the routing table)."""
        present = set(urls)
        for url in [url for url in self._states if url not in present]:
            del self._states[url]
        self._refresh()

    def status(self, now: float, urls: Iterable[str] = ()) -> list[dict]:
        """One row per replica known to the detector, and per one of ``urls`` (metrics, the CLI)."""
        ejected = self.ejected(now)
        rows = []
        for url in sorted(set(self._states) | set(urls)):
            state = self._states.get(url, ReplicaOutlierState())
            rows.append({"url": url, "ejected": url in ejected,
                         "ejected_remaining_s": round(state.ejected_until_s - now, 3) if url in ejected else 0.0,
                         "times_ejected": self.times_ejected(url, now),
                         "consecutive_failures": state.consecutive_failures})
        return rows

    def _refresh(self) -> None:
        ejected = {url: s.ejected_until_s for url, s in self._states.items() if s.ejected_until_s is not None}
        self._ejected = frozenset(ejected)
        self._next_return_s = min(ejected.values(), default=math.inf)
