"""Picker: uniformly at random, ignoring scores.

``P(url) = 1 / n`` for each of the n candidates. The baseline the others are measured
against: with one random choice the most loaded of n replicas holds about
log n / log log n times the mean once many requests are in flight.

Worked example: candidates [a, b, c, d] → each with probability ¼.

>>> import random
>>> RandomPick().pick(["a", "b", "c", "d"], None, random.Random(3)) in {"a", "b", "c", "d"}
True
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence


class RandomPick:
    """A uniform draw among the candidates."""

    __slots__ = ()

    def pick(self, candidates: Sequence[str], score: Callable[[str], float] | None, rng: random.Random) -> str:
        return candidates[int(rng.random() * len(candidates))]
