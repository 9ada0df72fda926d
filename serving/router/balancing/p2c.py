"""Power of two choices on in-flight work.

Pick two distinct replicas uniformly at random and send the request to the one with less
work in flight (ties: the first drawn). The router counts work in model units (the
request's estimated replica time from the cost model, ``serving.router.cost``), or in
requests where an endpoint has no cost model yet. With n replicas the most loaded one receives a
request only if it is drawn together with an equally loaded one: max load grows like
log log n instead of log n / log log n for one random choice (Mitzenmacher, 2001).

Example: in-flight {a: 3, b: 0, c: 5}; draws (c, b) → b; draws (a, c) → a.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence


def pick(candidates: Sequence[str], in_flight: Mapping[str, float], rng: random.Random) -> str:
    if not candidates:
        raise ValueError("no candidates to pick from")
    if len(candidates) == 1:
        return candidates[0]
    first, second = rng.sample(list(candidates), 2)
    return second if in_flight.get(second, 0) < in_flight.get(first, 0) else first
