"""The oracle: perfect foresight of demand, the same cold starts and per-replica capacity.

It knows every tick's arrivals in advance and the replica's capacity at the SLO
(``ReplicaModel.capacity_at_slo``: the most requests a second one replica carries with the
target share of requests within the SLO). It needs ``need(t) = ceil(arrivals(t) / capacity)``
ready replicas at each tick, and orders at ``t`` the most any tick of ``[t, t + lead]`` needs,
``lead`` being the cold start's p99: every replica is started one cold start before it is
needed, and kept through a gap shorter than a cold start (stopping it would only mean
starting it again). No policy that sees only the past, at the same capacity and cold start,
can hold the SLO with fewer replica-hours; the table reports every policy as a multiple of it.
"""

from __future__ import annotations

import numpy as np

from autoscale.sim.fleet import replicas_for_rate
from autoscale.sim.view import FleetView


def sliding_max_ahead(values: np.ndarray, window: int) -> np.ndarray:
    """``out[t] = max(values[t : t + window + 1])``, in O(n log window) by doubling.

        >>> sliding_max_ahead(np.array([1, 5, 2, 0, 0, 3]), 2).tolist()
        [5, 5, 2, 3, 3, 3]
    """
    out = values.copy()
    span = 1  # out[t] covers values[t : t + span]
    while span < window + 1:
        step = min(span, window + 1 - span)
        shifted = np.concatenate([out[step:], np.full(step, out.min() if len(out) else 0)])
        out = np.maximum(out, shifted)
        span += step
    return out


class Oracle:
    name = "oracle"

    def __init__(self, arrivals: np.ndarray, tick_s: float, rps_per_replica: float, lead_s: float,
                 min_replicas: int = 1, max_replicas: int | None = None) -> None:
        need = np.array([replicas_for_rate(a / tick_s, rps_per_replica) for a in arrivals.tolist()])
        plan = np.maximum(sliding_max_ahead(need, int(np.ceil(lead_s / tick_s))), min_replicas)
        self.plan = plan if max_replicas is None else np.minimum(plan, max_replicas)
        self._tick_s = tick_s

    def decide(self, view: FleetView) -> int:
        return int(self.plan[min(int(round(view.now_s / self._tick_s)), len(self.plan) - 1)])
