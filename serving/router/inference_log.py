"""The router's inference log writer: sampled records, buffered in memory, written in batches.

The request path only calls :meth:`InferenceLogWriter.offer`, which appends to a bounded
buffer and returns; it never awaits and never touches the database. A flush loop
(:meth:`InferenceLogWriter.run`) takes batches off the buffer and hands them to a
:class:`LogSink` (``controlplane.inference_log.InferenceLogStore``) in a worker thread.

When the database is slow or down, the buffer fills up and further records are dropped
and counted, not queued and not waited for: the log is a sample, and a request must never
be slower, or fail, because the database is. The wiring, in the router's lifespan::

    writer = InferenceLogWriter(InferenceLogStore(engine))
    task = asyncio.create_task(writer.run())
    ...                      # requests: if sample(rate, rng): writer.offer(record)
    await writer.close()     # on shutdown: flush what is buffered, bounded by a timeout
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import random
import threading
import time
from collections import deque
from typing import Protocol, Sequence

from controlplane.inference_log import InferenceRecord

log = logging.getLogger(__name__)


class LogSink(Protocol):
    """Where batches of records go. Called in a worker thread, so it may block."""

    def write(self, records: Sequence[InferenceRecord]) -> None: ...


class MemorySink:
    """A :class:`LogSink` in memory, for tests: it can fail its next writes, be slow, or be paused."""

    def __init__(self, fail_writes: int = 0, delay_s: float = 0.0) -> None:
        self.batches: list[list[InferenceRecord]] = []
        self.fail_writes = fail_writes  # the next this many writes raise ConnectionError
        self.delay_s = delay_s  # every write takes at least this long
        self.calls = 0
        self.most_concurrent_writes = 0  # more than 1: two writes overlapped
        self._writing = 0
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()

    @property
    def records(self) -> list[InferenceRecord]:
        with self._lock:
            return [record for batch in self.batches for record in batch]

    def pause(self) -> None:
        """Writes from now on block until :meth:`resume` (a database that stopped answering)."""
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def write(self, records: Sequence[InferenceRecord]) -> None:
        with self._lock:
            self._writing += 1
            self.most_concurrent_writes = max(self.most_concurrent_writes, self._writing)
        try:
            self._open.wait()
            time.sleep(self.delay_s)
            with self._lock:
                self.calls += 1
                if self.fail_writes > 0:
                    self.fail_writes -= 1
                    raise ConnectionError("memory sink told to fail")
                self.batches.append(list(records))
        finally:
            with self._lock:
                self._writing -= 1


class InferenceLogWriter:
    """Buffers records on the event loop and writes them to ``sink`` in batches.

    ``max_buffer``: records held at most; an offer beyond it is dropped (``dropped``).
    ``batch_size``: records per write; a full batch is written at once, a partial one after
    ``flush_interval_s``. ``close_timeout_s``: how long :meth:`close` waits for the last writes.

    Counters (records): ``written`` reached the sink, ``failed`` were in a write that raised
    (logged, then dropped: never retried, so a broken database cannot grow the buffer),
    ``dropped`` found the buffer full or the writer closed, ``buffered`` wait now.
    """

    def __init__(self, sink: LogSink, max_buffer: int = 10_000, batch_size: int = 500,
                 flush_interval_s: float = 1.0, close_timeout_s: float = 5.0) -> None:
        if max_buffer < 1 or batch_size < 1 or flush_interval_s <= 0:
            raise ValueError("max_buffer and batch_size must be at least 1 and flush_interval_s above 0")
        self.sink = sink
        self.max_buffer, self.batch_size = max_buffer, batch_size
        self.flush_interval_s, self.close_timeout_s = flush_interval_s, close_timeout_s
        self.written = self.dropped = self.failed = 0
        self._buffer: deque[InferenceRecord] = deque()
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self._closing = False
        self._running = False

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def offer(self, record: InferenceRecord) -> bool:
        """Buffer ``record`` for the next write; False (and counted in ``dropped``) when the buffer
        is full or the writer closed. Never blocks: call it from the event loop's thread."""
        if self._closing or len(self._buffer) >= self.max_buffer:
            self.dropped += 1
            return False
        self._buffer.append(record)
        if len(self._buffer) >= self.batch_size:
            self._wake.set()
        return True

    async def run(self) -> None:
        """The flush loop: write what is buffered every ``flush_interval_s``, or as soon as a batch is full.

        Runs until :meth:`close`; a failing write never ends it.
        """
        self._running = True
        try:
            while not self._closing:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=self.flush_interval_s)
                except TimeoutError:
                    pass
                self._wake.clear()
                await self._drain()  # after close(): offer refuses new records, so this empties the buffer
        finally:
            self._running = False
            self._stopped.set()

    async def close(self) -> None:
        """Stop taking records, write what is buffered (waiting at most ``close_timeout_s``) and
        stop the loop. Records still buffered after the timeout are dropped and counted."""
        self._closing = True
        self._wake.set()
        try:
            if self._running:
                await asyncio.wait_for(self._stopped.wait(), timeout=self.close_timeout_s)
            else:
                await asyncio.wait_for(self._drain(), timeout=self.close_timeout_s)
        except TimeoutError:
            log.warning("inference log: closing timed out after %gs; %d buffered records dropped",
                        self.close_timeout_s, len(self._buffer))
        self.dropped += len(self._buffer)
        self._buffer.clear()

    async def _drain(self) -> None:
        """Write the records buffered when it began, ``batch_size`` at a time (all of them once closing).

        Records offered while these are written wait for the next flush: a full batch wakes it at
        once, a partial one after ``flush_interval_s``. (Draining until the buffer was empty made a
        busy router write every few records as they came, one transaction each: 15-20 a second
        per router under a flood of requests, instead of one.) Only one drain ever runs: close()
        drains itself only while run() is not running, and a run() that starts after close() exits."""
        due = len(self._buffer)
        while self._buffer and (due > 0 or self._closing):
            batch = [self._buffer.popleft() for _ in range(min(self.batch_size, len(self._buffer)))]
            due -= len(batch)
            try:
                await asyncio.to_thread(self.sink.write, batch)
            except Exception as exc:  # noqa: BLE001 - any sink failure: log, count, drop, go on
                self.failed += len(batch)
                log.warning("inference log: writing %d records failed, they are dropped (%d so far): %s: %s",
                            len(batch), self.failed, type(exc).__name__, exc)
            else:
                self.written += len(batch)


def sample(rate: float, rng: random.Random) -> bool:
    """Whether to log this request: true for a share ``rate`` (0 to 1) of requests.

    >>> rng = random.Random(7)
    >>> sample(0.0, rng), sample(1.0, rng)
    (False, True)
    >>> sum(sample(0.25, rng) for _ in range(10_000))  # about 2,500
    2513
    """
    if rate <= 0.0:
        return False
    return rate >= 1.0 or rng.random() < rate


def capped(text: bytes, max_bytes: int) -> str | None:
    """A body as text for the log: UTF-8 (bad bytes replaced), cut after ``max_bytes`` bytes, the cut
    marked with how many bytes it left out. None when ``max_bytes`` is 0 (payloads not kept).

    A cut never splits a character: its partial bytes are counted as left out.

    >>> capped(b'{"text": "hello"}', 64)
    '{"text": "hello"}'
    >>> capped("héllo wörld".encode(), 2)  # "é" is 2 bytes: it does not fit
    'h…[truncated 12 bytes]'
    >>> capped(b"\\xff ok", 64), capped(b"secret", 0)
    ('\\ufffd ok', None)
    """
    if max_bytes <= 0:
        return None
    if len(text) <= max_bytes:
        return text.decode("utf-8", errors="replace")
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    head = decoder.decode(text[:max_bytes], final=False)
    left_out = len(text) - max_bytes + len(decoder.getstate()[0])
    return f"{head}…[truncated {left_out} bytes]"
