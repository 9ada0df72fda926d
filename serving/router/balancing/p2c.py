"""Picker: power of two choices.

Draw two distinct candidates uniformly at random (every ordered pair equally likely) and
take the one with the higher score; on a tie, the first drawn. With the in-flight scorers,
the most loaded of n replicas receives a request only if it is drawn together with an
equally loaded one: max load grows like log log n instead of log n / log log n for one
random choice (Mitzenmacher, 2001). Only the two drawn replicas are scored.

Worked example: scores {a: 1/(1+3), b: 1/(1+0), c: 1/(1+5)}; draws (c, b) → b;
draws (a, c) → a. ``pick`` keeps the router's older call, on raw in-flight counts (lower wins).

>>> import random
>>> draw_two(3, random.Random(0)), draw_two(3, random.Random(1))  # (c, b) and (a, c)
((2, 1), (0, 2))
>>> scores = {"a": 1 / (1 + 3), "b": 1 / (1 + 0), "c": 1 / (1 + 5)}
>>> [PowerOfTwoChoices().pick(["a", "b", "c"], scores.get, random.Random(seed)) for seed in (0, 1)]
['b', 'a']
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence


def draw_two(n: int, rng: random.Random) -> tuple[int, int]:
    """Two distinct indices in [0, n), uniformly over the n·(n-1) ordered pairs (n ≥ 2).

    ``int(random() * n)`` instead of ``randrange``: a third of the cost, and its bias
    (2⁻⁵³ per index) is far below anything a router could notice.
    """
    first = int(rng.random() * n)
    second = int(rng.random() * (n - 1))
    return first, second + (second >= first)


class PowerOfTwoChoices:
    """Higher score of two distinct uniform draws; ties go to the first drawn."""

    __slots__ = ()

    def pick(self, candidates: Sequence[str], score: Callable[[str], float], rng: random.Random) -> str:
        if len(candidates) == 1:
            return candidates[0]
        i, j = draw_two(len(candidates), rng)
        first, second = candidates[i], candidates[j]
        return second if score(second) > score(first) else first


def pick(candidates: Sequence[str], in_flight: Mapping[str, float], rng: random.Random) -> str:
    """The router's original call: the less loaded of two draws on raw in-flight counts."""
    if not candidates:
        raise ValueError("no candidates to pick from")
    if len(candidates) == 1:
        return candidates[0]
    i, j = draw_two(len(candidates), rng)
    first, second = candidates[i], candidates[j]
    return second if in_flight.get(second, 0) < in_flight.get(first, 0) else first
