"""Sticky routing: each key has a home replica on a hash ring, which takes it unless overloaded.

Requests with the same key (a session header, or the prompt's prefix: ``keys.py``) go to the
same replica, whose KV cache already holds their prefix, as long as that replica is not
carrying much more than its share. The rule is consistent hashing with bounded loads
(Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA 2018).

**Bound.** Over the n eligible candidates (not ejected; all of them if every one is),
with ``U`` their in-flight units, ``cost`` this request's units and ``c`` the load factor::

    bound = c · (U + cost) / n        (c times the mean load once this request is placed)

A replica may take the request iff ``units[url] ≤ bound``: its load before the request is at
most ``c`` times the mean after it, so its load after is at most ``c · mean + cost``. This is the paper's rule with real
numbers for balls: a bin accepts while its load is below the capacity ``⌈c·m/n⌉`` and so
ends at most one ball over ``c·m/n``. (Testing ``units[url] + cost ≤ bound`` instead would
leave no replica eligible at low load: 8 idle replicas, cost 1, c = 1.25 give 1 ≤ 0.156.)

**Never empty.** The least-loaded eligible replica holds at most the mean, ``U / n``, and
``U / n ≤ (U + cost) / n ≤ c · (U + cost) / n`` for ``cost ≥ 0`` and ``c ≥ 1``. So the
replicas within the bound always include it.

**Our variation.** When the home replica is over the bound (or ejected, or not a
candidate), the paper walks the ring to the next replica under its capacity; we instead let
the fallback balancer (power of two choices) pick among all replicas within the bound. The
key's overflow spreads over the lightly loaded replicas instead of piling onto the home's ring
neighbour, and the guarantee is the same: no replica takes a request above the bound.

Worked example, c = 1.25, cost 2, in flight {a: 6, b: 2, c: 0, d: 0}: bound = 1.25 · (8 + 2) / 4
= 3.125. A key homed on b goes to b (2 ≤ 3.125); a key homed on a (6 > 3.125) goes to P2C
over {b, c, d}.

>>> import random
>>> from serving.router.balancing import Snapshot, make_balancer
>>> ring = HashRing(["a", "b", "c", "d"])
>>> ring.home("user-0"), ring.home("user-1")
('b', 'a')
>>> snapshot = Snapshot(units={"a": 6.0, "b": 2.0}, requests={}, cost=2.0)
>>> bounded_pick("user-0", ["a", "b", "c", "d"], snapshot, ring, 1.25, make_balancer(), random.Random(0))
('b', True)
>>> bounded_pick("user-1", ["a", "b", "c", "d"], snapshot, ring, 1.25, make_balancer(), random.Random(0))
('d', False)
"""

from __future__ import annotations

import functools
import random
from bisect import bisect_right
from collections.abc import Sequence
from hashlib import blake2b

from serving.router.balancing.base import Balancer, Snapshot


def stable_hash(text: str) -> int:
    """64-bit hash equal in every process (Python's ``hash`` of a str is salted per process)."""
    return int.from_bytes(blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing: each replica owns ``vnodes`` points on a 64-bit ring; a key's home
    is the owner of the first point at or after the key's hash (wrapping around).

    Only the set of URLs matters, not their order, so every router process agrees. Removing
    a replica moves only the keys it was home to. Building costs ``len(urls) · vnodes``
    hashes: reuse rings with :func:`ring_for`.
    """

    __slots__ = ("urls", "_points", "_owners")

    def __init__(self, urls: Sequence[str], vnodes: int = 160) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be ≥ 1, got {vnodes}")
        self.urls = tuple(sorted(set(urls)))
        if not self.urls:
            raise ValueError("a hash ring needs at least one replica")
        points = sorted((stable_hash(f"{url}#{i}"), url) for url in self.urls for i in range(vnodes))
        self._points = [point for point, _ in points]
        self._owners = [url for _, url in points]

    def home(self, key: str) -> str:
        index = bisect_right(self._points, stable_hash(key))
        return self._owners[index if index < len(self._owners) else 0]


@functools.lru_cache(maxsize=256)
def ring_for(urls: tuple[str, ...]) -> HashRing:
    """The ring of a replica set, built once per distinct tuple (the last 256 kept)."""
    return HashRing(urls)


def bounded_pick(key: str, candidates: Sequence[str], snapshot: Snapshot, ring: HashRing, load_factor: float,
                 fallback: Balancer, rng: random.Random) -> tuple[str, bool]:
    """``(url, went_home)``: the key's home replica if it is eligible and within the bound, else
    the fallback's pick among the eligible replicas within the bound. ``went_home`` says whether
    the request landed on its key's home (in the fallback only if every candidate is ejected)."""
    if load_factor < 1:
        raise ValueError(f"load_factor must be ≥ 1, got {load_factor}")
    if not candidates:
        raise ValueError("no candidates to pick from")
    ejected, units = snapshot.ejected, snapshot.units
    eligible = candidates
    if ejected:
        eligible = [url for url in candidates if url not in ejected] or candidates
    bound = load_factor * (sum(units.get(url, 0.0) for url in eligible) + snapshot.cost) / len(eligible)
    home = ring.home(key)
    if home not in ejected and units.get(home, 0.0) <= bound and home in eligible:
        return home, True
    # Never empty (see the module docstring); min() only guards against float rounding at cost 0.
    within = [url for url in eligible if units.get(url, 0.0) <= bound] or \
        [min(eligible, key=lambda url: units.get(url, 0.0))]
    url = fallback.pick(within, snapshot, rng)
    return url, url == home
