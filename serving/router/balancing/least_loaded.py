"""Picker: the best score over every candidate (a full scan, O(n) scores per request).

``pick = argmax_url score(url)``; when several candidates share the best score, one of them
uniformly at random (so equal replicas share the traffic instead of the first one taking it
all). Deterministic given the scores, unlike power of two choices, so under a burst every
router process sends to the same replica: prefer ``p2c`` unless there are few replicas.

Worked example: scores {a: 0.25, b: 1.0, c: 1.0} → b or c, each with probability ½.

>>> import random
>>> scores = {"a": 0.25, "b": 1.0, "c": 1.0}
>>> sorted({LeastLoaded().pick(["a", "b", "c"], scores.get, random.Random(seed)) for seed in range(20)})
['b', 'c']
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence


class LeastLoaded:
    """Highest score over all candidates; ties broken uniformly at random."""

    __slots__ = ()

    def pick(self, candidates: Sequence[str], score: Callable[[str], float], rng: random.Random) -> str:
        best_score = -1.0
        best: list[str] = []
        for url in candidates:
            value = score(url)
            if value > best_score:
                best_score, best = value, [url]
            elif value == best_score:
                best.append(url)
        return best[0] if len(best) == 1 else best[int(rng.random() * len(best))]
