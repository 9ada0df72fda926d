"""Traffic across an endpoint's revisions: the canary split and shadow copies (pure, no I/O).

An endpoint routes to its serving revision. Besides it, the control plane may set

- a **canary**: another revision taking ``percent`` of the requests (a weighted coin per
  request: over n requests the canary's share has standard deviation
  √(p(1−p)/n), 0.67 points for 10 % of 2,000);
- a **shadow**: a revision receiving a copy of ``percent`` of the requests, whose answers are
  discarded; only its latency and status are recorded, beside the serving revision's.

A split whose revision has no ready replica takes nothing: its requests stay on the serving
revision (a canary still loading never fails a request).

>>> import random
>>> canary, rng = Split("gec-v2", ("http://b",), 25.0), random.Random(7)
>>> picks = [choose(("http://a",), "gec-v1", canary, rng)[2] for _ in range(1000)]
>>> 200 < picks.count("canary") < 300
True
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from serving.router.cost import RouteCost


@dataclass(frozen=True)
class Split:
    revision_id: str
    replicas: tuple[str, ...]  # ready replicas of that revision
    percent: float  # 0-100
    cost: RouteCost | None = None

    def takes(self, rng: random.Random) -> bool:
        return bool(self.replicas) and rng.random() * 100 < self.percent


def choose(serving: tuple[str, ...], serving_revision: str, canary: Split | None,
           rng: random.Random) -> tuple[str, tuple[str, ...], str]:
    """(revision id, its ready replicas, role "serve" | "canary") for one request."""
    if canary is not None and canary.takes(rng):
        return canary.revision_id, canary.replicas, "canary"
    return serving_revision, serving, "serve"


def shadow_for(shadow: Split | None, rng: random.Random) -> Split | None:
    """The shadow revision this request is copied to, if any."""
    return shadow if shadow is not None and shadow.takes(rng) else None
