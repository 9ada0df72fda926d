"""What a scaling policy sees of the simulated fleet each tick, and the one call it answers.

Every policy the day model compares (modelplane's controller, the anchors in
``autoscale.sim.anchors``, static peak, the oracle) is driven through this Protocol: once
per tick (1 simulated second) it gets a :class:`FleetView` and returns the replica count it
orders (ready + starting). The fleet then starts or stops replicas to match; a started
replica becomes ready after its cold start.

``in_flight`` is what the routers count for the endpoint: requests answered by no replica
yet, running inside an engine or queued (inside an engine or at the router). It is the
signal modelplane's horizontal policy scales on, and the concurrency Knative, Ray Serve and
AIBrix scale on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class FleetView:
    """The fleet at ``now_s``, after this tick's arrivals and completions.

    ``in_flight``: requests in flight (running + queued), summed over routers;
    ``running``: the part of it inside engines' batches; ``queued``: the rest (waiting);
    ``ready``/``starting``: replicas serving / ordered and still loading;
    ``desired``: the last count ordered; ``arrivals_rps``: requests that arrived this tick,
    per second; ``p99_latency_ms``: p99 of the requests that finished this tick (None when
    none did); ``utilization``: running / (ready × the concurrency at which a replica's
    throughput peaks), 0..1 (0 with no replica ready).
    """

    now_s: float
    in_flight: float
    running: float
    queued: float
    ready: int
    starting: int
    desired: int
    arrivals_rps: float
    p99_latency_ms: float | None
    utilization: float


class ScalingPolicy(Protocol):
    """A replica-count policy: ``decide`` is called every tick with the fleet as it is now."""

    name: str

    def decide(self, view: FleetView) -> int:
        """The replica count to converge to (ready + starting)."""
