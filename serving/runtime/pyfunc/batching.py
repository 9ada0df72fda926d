"""Micro-batching decisions: when to run the queue, which requests share a predict call, and
how a batch's predictions split back. Pure functions of the queue and the time; the asyncio
loop that applies them is :mod:`.batcher`.

The unit of a batch is *rows* (``max_batch_rows``): a predict call's cost grows with its rows,
not with the number of HTTP requests they came in.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_rows: int = 64
    max_batch_wait_ms: float = 2.0


class Batchable(Protocol):
    @property
    def batch_key(self) -> Hashable | None: ...

    @property
    def row_count(self) -> int: ...


def dispatch_delay_s(policy: BatchPolicy, *, now_s: float, oldest_enqueued_s: float, queued_rows: int,
                     arriving_requests: int) -> float:
    """Seconds to wait for more requests before the next predict call; 0.0 = run it now.

    Run now when the queue already holds ``max_batch_rows`` rows, when no other request is
    being received (nobody could join, so waiting only adds latency: a lone client never pays
    the wait), or when the oldest queued request has waited ``max_batch_wait_ms``.

    Worked example: wait 2 ms, the oldest request queued at t = 10.0000 s, now 10.0005 s,
    3 of 64 rows queued and 2 requests still being read → wait 0.0015 s more.

    >>> dispatch_delay_s(BatchPolicy(64, 2.0), now_s=10.0005, oldest_enqueued_s=10.0, queued_rows=3,
    ...                  arriving_requests=2)
    0.0015
    """
    if queued_rows >= policy.max_batch_rows or arriving_requests <= 0:
        return 0.0
    remaining = oldest_enqueued_s + policy.max_batch_wait_ms / 1000 - now_s
    return round(max(0.0, remaining), 9)


def select_batch(queue: Sequence[Batchable], max_batch_rows: int) -> list[int]:
    """Indexes of the queued requests that go into the next predict call, in arrival order.

    The oldest request always goes (alone if it exceeds the cap by itself, or has no batch
    key); then every later request with the same key, as long as the rows stay within
    ``max_batch_rows``. The others keep their place for the next call.

    Worked example, cap 64: keys/rows ``[A/1, B/1, A/2, A/63, A/4]`` → ``[0, 2, 4]``
    (1 + 2 + 4 = 7 rows; B has another key; 1 + 2 + 63 = 66 would exceed the cap).
    """
    if not queue:
        return []
    head = queue[0]
    chosen, rows = [0], head.row_count
    if head.batch_key is None:
        return chosen
    for index in range(1, len(queue)):
        item = queue[index]
        if item.batch_key == head.batch_key and rows + item.row_count <= max_batch_rows:
            chosen.append(index)
            rows += item.row_count
            if rows >= max_batch_rows:
                break
    return chosen


def row_bounds(row_counts: Sequence[int]) -> list[tuple[int, int]]:
    """Each request's ``[start, stop)`` rows in the concatenated batch.

    >>> row_bounds([1, 3, 2])
    [(0, 1), (1, 4), (4, 6)]
    """
    bounds, start = [], 0
    for count in row_counts:
        bounds.append((start, start + count))
        start += count
    return bounds
