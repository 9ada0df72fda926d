"""The balancer's pipeline: filters drop replicas, scorers rank them, a picker chooses.

Every plugin reads a :class:`Snapshot` of the router's counters and does no I/O. The router
hands in its live dictionaries (no copies, this runs per request), so a plugin only reads them.
A :class:`Balancer` runs the pipeline; ``serving.router.balancing.BALANCERS`` names the
combinations the router offers.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the router knows about one endpoint's replicas when a request arrives.

    ``units``: model units in flight per replica URL; ``requests``: requests in flight per URL
    (a missing URL counts 0 in both); ``ejected``: URLs the outlier detector took out;
    ``cost``: this request's model units (``serving.router.cost.request_units``).
    """

    units: Mapping[str, float]
    requests: Mapping[str, int]
    ejected: Set[str] = frozenset()
    cost: float = 1.0


class Filter(Protocol):
    """Drops the replicas that must not take the request; returns the ones that may."""

    def __call__(self, candidates: Sequence[str], snapshot: Snapshot) -> Sequence[str]: ...


class Scorer(Protocol):
    """Rates one replica in [0, 1], higher is better; combined with the others by weight."""

    def score(self, url: str, snapshot: Snapshot) -> float: ...


class Picker(Protocol):
    """Chooses one of ``candidates`` (never empty) given each one's combined score."""

    def pick(self, candidates: Sequence[str], score: Callable[[str], float], rng: random.Random) -> str: ...


def _constant(url: str) -> float:
    return 1.0


class Balancer:
    """Filters, then weighted scorers, then a picker: ``pick(candidates, snapshot, rng) -> url``.

    A filter that would leave no replica is skipped (its input is kept): a request is never
    failed because every replica was filtered out; an ejected replica is better than none.
    The combined score of a replica is the weighted mean of its scores,
    ``Σ wᵢ·sᵢ(url) / Σ wᵢ``. Scores are computed lazily, only for the replicas the picker
    asks about (two for power of two choices). One candidate is returned without scoring.

    >>> from serving.router.balancing import make_balancer
    >>> snapshot = Snapshot(units={"a": 3.0, "b": 0.0}, requests={}, ejected=frozenset({"b"}))
    >>> make_balancer("p2c_units").pick(["a", "b"], snapshot, random.Random(0))
    'a'
    >>> make_balancer("p2c_units").pick(["b"], snapshot, random.Random(0))  # only an ejected one left
    'b'
    """

    __slots__ = ("name", "filters", "scorers", "picker", "_total_weight")

    def __init__(self, name: str, filters: Sequence[Filter], scorers: Sequence[tuple[Scorer, float]],
                 picker: Picker) -> None:
        if any(weight <= 0 for _, weight in scorers):
            raise ValueError("scorer weights must be > 0")
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker
        self._total_weight = float(sum(weight for _, weight in scorers))

    def score(self, url: str, snapshot: Snapshot) -> float:
        """The combined score of one replica in [0, 1] (1 when there is no scorer)."""
        if not self.scorers:
            return 1.0
        return sum(weight * scorer.score(url, snapshot) for scorer, weight in self.scorers) / self._total_weight

    def pick(self, candidates: Sequence[str], snapshot: Snapshot, rng: random.Random) -> str:
        if not candidates:
            raise ValueError("no candidates to pick from")
        if len(candidates) == 1:
            return candidates[0]
        for keep in self.filters:
            kept = keep(candidates, snapshot)
            if kept:
                candidates = kept
        if len(candidates) == 1:
            return candidates[0]
        return self.picker.pick(candidates, self._score_function(snapshot), rng)

    def _score_function(self, snapshot: Snapshot) -> Callable[[str], float]:
        if not self.scorers:
            return _constant
        if len(self.scorers) == 1:  # the common case: no weighted sum to compute
            scorer = self.scorers[0][0]
            return lambda url: scorer.score(url, snapshot)
        return lambda url: self.score(url, snapshot)
