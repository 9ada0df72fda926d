"""A concurrency limit per endpoint, with a bounded first-in first-out wait queue (asyncio).

At most ``max_concurrent`` requests hold a slot at once. A request that finds them all taken
waits its turn, in arrival order, for at most ``max_wait_s``:

- it gets a slot as soon as one is released (the releasing request hands its slot straight to
  the head of the queue, so a newcomer can never overtake a waiter);
- with ``max_queued`` requests already waiting it is refused at once: **429**, ``Retry-After``;
- after ``max_wait_s`` without a slot it gives up: **503**, ``Retry-After``.

A waiter cancelled because its client went away leaves the queue; if a slot was handed to it
in the same instant, the slot passes on to the next waiter, so no slot leaks and no dead waiter
blocks the head. ``update`` changes the limits at runtime: a higher ``max_concurrent`` lets
waiters in at once; a lower one takes effect as running requests finish (none is interrupted);
a lower ``max_queued`` or ``max_wait_s`` applies to requests that arrive afterwards.

Worked example: ``max_concurrent=2, max_queued=1``. Requests A and B run; C waits; D is refused
with 429 ("… has 2 requests running and 1 waiting, its limit …"); when A finishes C runs.

>>> import asyncio
>>> async def example():
...     gate = ConcurrencyGate(2, 1, 5.0, name="endpoint 'gec'")
...     await gate.acquire(); await gate.acquire()  # A and B
...     c = asyncio.ensure_future(gate.acquire()); await asyncio.sleep(0)
...     try:
...         await gate.acquire()  # D
...     except RouterError as refused:
...         print(refused.status, refused)
...     gate.release(); await c  # A finishes, C runs
...     return gate.running, gate.waiting
>>> asyncio.run(example())
429 endpoint 'gec' has 2 requests running and 1 waiting, its limit; retry after 1 s
(2, 0)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from serving.router.errors import RouterError


class ConcurrencyGate:
    """Slots for one endpoint; see the module docstring. ``name`` starts every message (e.g. "endpoint 'gec'")."""

    def __init__(self, max_concurrent: int, max_queued: int, max_wait_s: float, *, name: str = "this endpoint",
                 retry_after_s: int = 1) -> None:
        self.name, self.retry_after_s = name, retry_after_s
        self._running = 0
        # Futures of waiting requests, oldest first; each resolves True (a slot is yours) or False
        # (timed out). One cancelled by its client may linger until its task runs: skipped and not counted.
        self._waiters: deque[asyncio.Future[bool]] = deque()
        self.update(max_concurrent, max_queued, max_wait_s)

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return self._running

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return sum(1 for waiter in self._waiters if not waiter.done())

    def update(self, max_concurrent: int, max_queued: int, max_wait_s: float) -> None:
        """New limits (the endpoint's spec was edited); waiters that now fit get their slots at once."""
        if max_concurrent < 1 or max_queued < 0 or max_wait_s < 0:
            raise ValueError(f"need max_concurrent >= 1, max_queued >= 0, max_wait_s >= 0; got {max_concurrent}, "
                             f"{max_queued}, {max_wait_s}")
        self.max_concurrent, self.max_queued, self.max_wait_s = max_concurrent, max_queued, max_wait_s
        self._hand_over()

    async def acquire(self) -> None:
        """Take a slot, waiting for one if need be; RouterError 429 (queue full) or 503 (waited too long)."""
        if self._running < self.max_concurrent and not self.waiting:
            self._running += 1
            return
        waiting = self.waiting
        if waiting >= self.max_queued:
            raise RouterError(429, f"{self.name} has {self._running} requests running and {waiting} waiting, its "
                                   f"limit; retry after {self.retry_after_s} s", self._retry_after())
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_later(self.max_wait_s, self._time_out, waiter)
        try:
            got_slot = await waiter
        except asyncio.CancelledError:
            if waiter.cancelled():  # still waiting: leave the queue
                self._leave(waiter)
            elif waiter.result():  # a slot was handed over as the client went away: pass it on
                self.release()
            raise
        finally:
            timer.cancel()
        if not got_slot:
            raise RouterError(503, f"{self.name} waited {self.max_wait_s:g} s for a free slot and none came "
                                   f"({self._running} requests running, its limit of {self.max_concurrent}); "
                                   f"retry after {self.retry_after_s} s", self._retry_after())

    def release(self) -> None:
        """Give a slot back: to the longest waiter if any, else to the pool."""
        if self._running <= 0:
            raise RuntimeError(f"{self.name}: release() without a matching acquire()")
        self._running -= 1
        self._hand_over()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """``async with gate.slot(): ...`` holds a slot for the block."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    def _hand_over(self) -> None:
        while self._waiters and self._running < self.max_concurrent:
            waiter = self._waiters.popleft()
            if waiter.done():  # cancelled, its task not yet run: not a waiter any more
                continue
            self._running += 1
            waiter.set_result(True)

    def _time_out(self, waiter: asyncio.Future[bool]) -> None:
        if not waiter.done():
            self._leave(waiter)
            waiter.set_result(False)

    def _leave(self, waiter: asyncio.Future[bool]) -> None:
        with contextlib.suppress(ValueError):  # already skipped by _hand_over
            self._waiters.remove(waiter)

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}
