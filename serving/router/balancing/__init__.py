"""Balancing plugins: filters drop replicas, scorers rank them, a picker chooses (no I/O).

``make_balancer(name)`` builds one of the :data:`BALANCERS`:

- ``p2c_units`` (default): drop ejected replicas, score ``1/(1 + in-flight units)``,
  power of two choices.
- ``p2c_requests``: the same on in-flight request counts (no cost model).
- ``least_loaded``: in-flight units, the best of all replicas (scores every one).
- ``round_robin``: rotation over the non-ejected replicas.
- ``random``: a uniform draw among the non-ejected replicas.

Sticky routing (a key's home replica, with bounded load) lives in ``sticky.py`` and its
keys in ``keys.py``. Every call to ``make_balancer`` returns a fresh object: round robin
keeps its position per balancer, so each endpoint gets its own.

>>> make_balancer("p2c_units").name
'p2c_units'
>>> make_balancer("nope")
Traceback (most recent call last):
...
ValueError: unknown balancer 'nope'; known: least_loaded, p2c_requests, p2c_units, random, round_robin
"""

from __future__ import annotations

from collections.abc import Callable

from serving.router.balancing.base import Balancer, Snapshot
from serving.router.balancing.least_loaded import LeastLoaded
from serving.router.balancing.not_ejected import not_ejected
from serving.router.balancing.p2c import PowerOfTwoChoices
from serving.router.balancing.random_pick import RandomPick
from serving.router.balancing.requests import RequestsInFlight
from serving.router.balancing.round_robin import RoundRobin
from serving.router.balancing.units import UnitsInFlight

__all__ = ["BALANCERS", "DEFAULT_BALANCER", "Balancer", "Snapshot", "make_balancer"]

DEFAULT_BALANCER = "p2c_units"

BALANCERS: dict[str, Callable[[], Balancer]] = {
    "p2c_units": lambda: Balancer("p2c_units", [not_ejected], [(UnitsInFlight(), 1.0)], PowerOfTwoChoices()),
    "p2c_requests": lambda: Balancer("p2c_requests", [not_ejected], [(RequestsInFlight(), 1.0)],
                                     PowerOfTwoChoices()),
    "least_loaded": lambda: Balancer("least_loaded", [not_ejected], [(UnitsInFlight(), 1.0)], LeastLoaded()),
    "round_robin": lambda: Balancer("round_robin", [not_ejected], [], RoundRobin()),
    "random": lambda: Balancer("random", [not_ejected], [], RandomPick()),
}


def make_balancer(name: str = DEFAULT_BALANCER) -> Balancer:
    """A fresh balancer by name; ValueError naming the known ones for any other name."""
    try:
        factory = BALANCERS[name]
    except KeyError:
        raise ValueError(f"unknown balancer {name!r}; known: {', '.join(sorted(BALANCERS))}") from None
    return factory()
