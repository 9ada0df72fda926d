"""Picker: round robin, ignoring scores.

State is explicit: ``next_index`` counts picks in this object, and a pick returns
``candidates[next_index mod n]``, then advances it. Over any n consecutive picks on the same
candidate list every candidate is picked exactly once. Each balancer made by
``make_balancer`` has its own picker, so each endpoint rotates on its own; a change in the
list (a replica ejected or added) shifts the rotation but never skips the whole cycle.

Worked example: candidates [a, b, c], next_index 0 → a, b, c, a, …

>>> import random
>>> picker = RoundRobin()
>>> [picker.pick(["a", "b", "c"], None, random.Random(0)) for _ in range(4)]
['a', 'b', 'c', 'a']
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence


class RoundRobin:
    """Rotates over the candidate list; ``next_index`` is its whole state."""

    __slots__ = ("next_index",)

    def __init__(self, next_index: int = 0) -> None:
        self.next_index = next_index

    def pick(self, candidates: Sequence[str], score: Callable[[str], float] | None, rng: random.Random) -> str:
        index = self.next_index % len(candidates)
        self.next_index = index + 1
        return candidates[index]
