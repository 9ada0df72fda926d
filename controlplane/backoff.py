"""Exponential backoff between restarts, shared by ``modelplane up`` (services) and the supervisor (replicas)."""

from __future__ import annotations


def restart_delay_s(restarts: int, initial_s: float, max_s: float) -> float:
    """Backoff before restart number ``restarts`` (1-based): 1, 2, 4 … capped at ``max_s``.

    >>> [restart_delay_s(n, 1.0, 30.0) for n in (1, 2, 3, 6, 7)]
    [1.0, 2.0, 4.0, 30.0, 30.0]
    """
    return min(max_s, initial_s * 2 ** max(0, restarts - 1))
