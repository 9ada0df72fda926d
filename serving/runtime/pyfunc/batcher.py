"""The asyncio side of micro-batching: a queue, one dispatch loop, one predict thread.

Handlers call :meth:`MicroBatcher.arrival_started` as a request comes in, then
:meth:`MicroBatcher.submit` (or :meth:`MicroBatcher.arrival_abandoned` if it is rejected
before that). The loop waits as :func:`.batching.dispatch_delay_s` says, takes the requests
:func:`.batching.select_batch` picks, and runs them in the predict thread. While one batch
predicts, the next one forms, so under load the wait costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from serving.runtime.pyfunc.batching import BatchPolicy, dispatch_delay_s, select_batch
from serving.runtime.pyfunc.payload import Invocation
from serving.runtime.pyfunc.responses import Outcome, error_outcome

logger = logging.getLogger(__name__)


class BatchObserver(Protocol):
    def queue_depth(self, requests: int) -> None: ...

    def batch_done(self, requests: int, rows: int) -> None: ...


@dataclass(eq=False)
class _Pending:
    invocation: Invocation
    enqueued_s: float
    future: asyncio.Future = field(repr=False)

    @property
    def batch_key(self):
        return self.invocation.batch_key

    @property
    def row_count(self) -> int:
        return self.invocation.row_count


class MicroBatcher:
    """Runs queued invocations through ``run_batch`` (called in the predict thread)."""

    def __init__(self, policy: BatchPolicy, observer: BatchObserver, executor: ThreadPoolExecutor,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.observer = observer
        self.executor = executor
        self.clock = clock
        self.run_batch: Callable[[list[Invocation]], list[Outcome]] | None = None  # set once the model is loaded
        self._queue: list[_Pending] = []
        self._queued_rows = 0
        self._arriving = 0
        self._wakeup = asyncio.Event()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def arrival_started(self) -> None:
        self._arriving += 1

    def arrival_abandoned(self) -> None:
        self._arriving -= 1
        if self._arriving == 0 and self._queue:
            self._wakeup.set()  # the batch was waiting for this request

    def submit(self, invocation: Invocation) -> asyncio.Future:
        """Queue a parsed request (after :meth:`arrival_started`); the future resolves to its Outcome."""
        self._arriving -= 1
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(invocation, self.clock(), future))
        self._queued_rows += invocation.row_count
        self.observer.queue_depth(len(self._queue))
        self._wakeup.set()
        return future

    async def run(self) -> None:
        """The dispatch loop; runs until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            delay_s = dispatch_delay_s(self.policy, now_s=self.clock(), oldest_enqueued_s=self._queue[0].enqueued_s,
                                       queued_rows=self._queued_rows, arriving_requests=self._arriving)
            if delay_s > 0:
                self._wakeup.clear()
                timer = loop.call_later(delay_s, self._wakeup.set)
                await self._wakeup.wait()
                timer.cancel()
                continue
            batch = self._take(select_batch(self._queue, self.policy.max_batch_rows))
            await self._run(loop, batch)

    def _take(self, indexes: list[int]) -> list[_Pending]:
        chosen = set(indexes)
        batch = [self._queue[i] for i in indexes]
        self._queue = [item for i, item in enumerate(self._queue) if i not in chosen]
        self._queued_rows -= sum(item.row_count for item in batch)
        self.observer.queue_depth(len(self._queue))
        return batch

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[_Pending]) -> None:
        invocations = [item.invocation for item in batch]
        try:
            outcomes = await loop.run_in_executor(self.executor, self.run_batch, invocations)
        except Exception as exc:  # noqa: BLE001 - run_batch should never raise; answer rather than hang
            logger.exception("predict batch failed")
            outcomes = [error_outcome(500, f"prediction failed: {exc!r}")] * len(batch)
        self.observer.batch_done(len(batch), sum(item.row_count for item in batch))
        for item, outcome in zip(batch, outcomes, strict=True):
            if not item.future.done():
                item.future.set_result(outcome)
