"""``LazyImage``: a seekable image served from the registry as it is read.

A read names image bytes; the fetcher finds the sectors that cover them, takes what the
:class:`~images.lazy.cache.SectorCache` holds, and fetches the rest with HTTP Range requests
on the data blob, merging sectors whose stored bytes are adjacent into one request
(:func:`images.lazy.plan.plan_runs`) and running the requests on a pool of ``parallel``
threads. Every sector is checked against its sha256 before a byte of it is used.

The guarantees a filesystem front end needs, and how they are kept:

- *Right bytes or EIO, never a hang.* A sector that fails its digest is fetched again on its
  own, ``retries`` times; a registry error is retried with exponential backoff
  (``backoff_s * 2**k``) through the injected ``sleep``, within ``read_budget_s`` in all. Then
  the read fails with ``OSError(EIO)`` naming the sector or the registry. The registry client
  owns the timeout of each request (``images.mount.sources``: 5 s without a byte). After a
  registry failure, reads that need the registry fail at once for ``down_hold_s``: the kernel
  asks again page by page and a loop device serves its readers one at a time, so without it a
  stopped registry would hold each reader for every retry of every reader before it.
- *One fetch per sector at a time.* A sector being fetched has a flight (an Event and its
  result); other readers of it wait for that flight instead of asking the registry again.
  The fetch puts the sector in the cache *before* its flight ends, so a reader that finds no
  flight finds the sector in the cache.
- *Start-up first, then the rest.* ``prefetch`` takes the sectors the runtime read while it
  started (recorded by :meth:`LazyImage.access_log` when the image was built);
  ``start_background_fill`` pulls every other sector afterwards, one modest batch at a time,
  waiting while a foreground read is fetching so it never stands in a read's way for more
  than one batch.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from images.lazy.cache import SectorCache
from images.lazy.plan import Run, batches, fill_order, plan_runs
from images.lazy.reader import SectorReader
from images.oci.registry import Registry, RegistryError, check_digest, sha256_digest
from images.seekable.codec import SectorCorrupt, decode_sector
from images.seekable.index import SectorIndex

log = logging.getLogger("modelplane.images.lazy")


@dataclass(frozen=True)
class FetchStats:
    """What serving the reads so far cost, for benchmarks."""

    bytes_fetched: int = 0  # stored (compressed) bytes received from the registry
    requests: int = 0  # Range requests answered
    sectors_fetched: int = 0  # sectors fetched and verified
    sectors_from_cache: int = 0  # non-hole sectors reads found in the cache
    corrupt_refetches: int = 0  # sectors fetched again because they failed their digest
    seconds_waiting: float = 0.0  # time reads spent waiting for fetches (theirs or others')


class _Flight:
    """One fetch of one sector in progress; every reader of that sector waits on it."""

    def __init__(self, wanted: bool) -> None:
        self.done = threading.Event()
        self.wanted = wanted  # someone will use the bytes; else they are dropped once cached
        self.data: bytes | None = None
        self.error: OSError | None = None


class LazyImage:
    """A :class:`images.source.BlockSource` over a seekable image in a registry.

    Thread-safe: a FUSE front end calls ``read`` from many threads at once.
    ``close()`` stops the background fill, waits for fetches in progress and closes the cache.
    """

    def __init__(self, registry: Registry, repo: str, index: SectorIndex, cache: SectorCache, *,
                 parallel: int = 8, max_request_bytes: int = 32 << 20, retries: int = 3, backoff_s: float = 0.2,
                 read_budget_s: float = 15.0, down_hold_s: float = 2.0,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
        if parallel < 1 or max_request_bytes < 1 or retries < 0 or backoff_s < 0 or read_budget_s <= 0 or down_hold_s < 0:
            raise ValueError(f"parallel ({parallel}) and max_request_bytes ({max_request_bytes}) must be >= 1, "
                             f"retries ({retries}), backoff_s ({backoff_s}) and down_hold_s ({down_hold_s}) >= 0, "
                             f"read_budget_s ({read_budget_s}) > 0")
        self.registry, self.repo, self.index, self.cache = registry, repo, index, cache
        self.data_digest = check_digest(index.data_digest)
        self.size = index.image_size
        self.parallel, self.max_request_bytes = parallel, max_request_bytes
        self._clock = clock
        self._pool = ThreadPoolExecutor(parallel, thread_name_prefix="lazy-fetch")
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when no foreground read is fetching
        self._flights: dict[int, _Flight] = {}
        self._counts = dict.fromkeys(("bytes_fetched", "requests", "sectors_fetched", "sectors_from_cache",
                                      "corrupt_refetches", "seconds_waiting"), 0)
        self._touched: dict[int, None] = {}  # first-touch order of reads (dicts keep insertion order)
        self._foreground_fetching = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._fill: threading.Thread | None = None
        self._closed = False
        self._reader = SectorReader(registry, repo, index, retries=retries, backoff_s=backoff_s,
                                    read_budget_s=read_budget_s, down_hold_s=down_hold_s, sleep=sleep, clock=clock,
                                    count=self._count)

    # -- BlockSource ----------------------------------------------------------------------

    def read(self, offset: int, length: int) -> bytes:
        """Image bytes ``[offset, offset + length)``, short only at the end of the image."""
        if offset < 0 or length < 0:
            raise OSError(errno.EINVAL, f"negative offset or length ({offset}, {length})")
        self._check_open()
        end = min(offset + length, self.size)
        if end <= offset:
            return b""
        pieces = {}  # sector → the part of it this read wants, in sector coordinates
        for number in self.index.covering(offset, end - offset):
            start, stop = self.index.span(number)
            pieces[number] = (max(offset, start) - start, min(end, stop) - start)
        with self._lock:
            for number in pieces:
                self._touched.setdefault(number)
        parts = self._foreground_pieces(pieces)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            self._idle.notify_all()
            threads = list(self._threads)
        for thread in threads:
            thread.join()
        self._pool.shutdown(wait=True)
        self.cache.close()

    def __enter__(self) -> LazyImage:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- prefetch, fill, records ----------------------------------------------------------

    def prefetch(self, numbers: Sequence[int], *, wait: bool = True) -> None:
        """Fetch ``numbers`` (sectors) in their order, ``parallel`` requests at a time.

        With ``wait=False`` a thread does it and logs a failure; with ``wait=True`` a failure
        raises ``OSError(EIO)`` after the batch it happened in.
        """
        self._check_open()
        ordered = list(dict.fromkeys(numbers))
        if wait:
            self._prefetch(ordered)
            return

        def prefetch_quietly() -> None:
            try:
                self._prefetch(ordered)
            except OSError as exc:
                log.warning("prefetch from %s stopped: %s", self.data_digest, exc)

        self._start_thread(threading.Thread(target=prefetch_quietly, name="lazy-prefetch", daemon=True))

    def start_background_fill(self) -> None:
        """Fetch every sector not yet cached: the recorded start-up order first, then ascending.

        One thread; a second call does nothing. It takes one batch (``max_request_bytes`` of
        stored bytes, spread over the pool) at a time, waits while foreground reads are
        fetching, stops when the cache bound is reached, and is joined by ``close()``.
        """
        with self._lock:
            if self._fill is not None:
                return
            self._fill = threading.Thread(target=self._fill_loop, name="lazy-fill", daemon=True)
        self._start_thread(self._fill)

    def access_log(self) -> list[int]:
        """Sector numbers in the order reads first touched them (not prefetch or fill)."""
        with self._lock:
            return list(self._touched)

    def stats(self) -> FetchStats:
        with self._lock:
            return FetchStats(**self._counts)

    # -- the fetch path -------------------------------------------------------------------

    def _foreground_pieces(self, pieces: dict[int, tuple[int, int]]) -> list[bytes]:
        """The wanted part of each sector, from the cache or fetched, in the order of ``pieces``."""
        found: dict[int, bytes] = {}
        for number, (start, stop) in pieces.items():
            data = self.cache.get(number, start, stop)
            if data is not None:
                found[number] = data
                if self.index.sectors[number].codec != "hole":
                    self._count(sectors_from_cache=1)
        missing = [n for n in pieces if n not in found]
        if missing:
            started = self._clock()
            with self._lock:
                self._foreground_fetching += 1
            try:
                for number, data in self._fetch(missing, self.max_request_bytes, collect=True).items():
                    start, stop = pieces[number]
                    found[number] = data[start:stop] if (start, stop) != (0, len(data)) else data
            finally:
                with self._lock:
                    self._foreground_fetching -= 1
                    self._counts["seconds_waiting"] += self._clock() - started
                    if not self._foreground_fetching:
                        self._idle.notify_all()
        return [found[number] for number in pieces]

    def _fetch(self, numbers: Iterable[int], request_bytes: int, *, collect: bool) -> dict[int, bytes]:
        """Fetch ``numbers`` (or wait for the flights already fetching them); OSError on failure."""
        owned: dict[int, _Flight] = {}
        waiting: dict[int, _Flight] = {}
        with self._lock:
            for number in dict.fromkeys(numbers):
                if number in self._flights:
                    waiting[number] = self._flights[number]
                    waiting[number].wanted |= collect
                else:
                    owned[number] = self._flights[number] = _Flight(wanted=collect)
        try:
            for number in list(owned):  # a flight that ended since our cache miss left its sector cached
                data = self.cache.get(number)
                if data is not None:
                    self._finish(number, data=data)
            to_fetch = [n for n, flight in owned.items() if not flight.done.is_set()]
            runs = plan_runs(self.index, to_fetch, request_bytes)
        except BaseException as exc:  # end our flights, or their other readers would wait forever
            for number, flight in owned.items():
                if not flight.done.is_set():
                    self._finish(number, error=OSError(errno.EIO, f"fetching sector {number} failed: {exc!r}"))
            raise
        self._run_all(runs)
        results: dict[int, bytes] = {}
        for number, flight in {**owned, **waiting}.items():
            flight.done.wait()  # every flight ends: _fetch_run finishes each one in a finally
            if flight.error is not None:  # a copy: other readers of the flight raise it too
                raise OSError(flight.error.errno, flight.error.strerror or str(flight.error)) from flight.error
            if collect:
                results[number] = flight.data
        return results

    def _run_all(self, runs: list[Run]) -> None:
        if len(runs) == 1:
            self._fetch_run(runs[0])
            return
        try:
            futures = [self._pool.submit(self._fetch_run, run) for run in runs]
        except RuntimeError:  # the pool was shut down: close() ran while this read was starting
            for run in runs:
                for number in run.numbers:
                    self._finish(number, error=OSError(errno.EBADF, "the lazy image was closed during the read"))
            return
        for future in futures:
            future.result()

    def _fetch_run(self, run: Run) -> None:
        """One Range request: decode and verify its sectors, cache them, end their flights."""
        decoded: dict[int, bytes] = {}
        errors: dict[int, OSError] = {}
        try:
            stored = self._reader.read_range(run.start, run.length)
            for number in run.numbers:
                sector = self.index.sectors[number]
                start, end = self.index.span(number)
                piece = stored[sector.offset - run.start:sector.offset - run.start + sector.length]
                try:
                    decoded[number] = decode_sector(sector, piece, end - start, number)
                except SectorCorrupt:
                    try:
                        decoded[number] = self._reader.refetch(number)
                    except OSError as exc:
                        errors[number] = exc
            self._count(sectors_fetched=len(decoded))
            try:
                self.cache.put_many(decoded)
            except OSError as exc:  # the bytes are right; only caching them failed
                log.warning("cannot cache sectors of %s: %s", self.data_digest, exc)
        except OSError as exc:
            errors.update((n, exc) for n in run.numbers if n not in decoded)
        finally:
            for number in run.numbers:
                if number in decoded:
                    self._finish(number, data=decoded[number])
                else:
                    self._finish(number, error=errors.get(number) or OSError(
                        errno.EIO, f"fetching sector {number} of {self.data_digest} failed"))

    def _finish(self, number: int, *, data: bytes | None = None, error: OSError | None = None) -> None:
        with self._lock:  # once popped no reader can join, so ``wanted`` is final
            flight = self._flights.pop(number)
        # A prefetch batch holds its flights until the batch ends; dropping the bytes nobody
        # asked for keeps its memory to the runs in progress, not the whole batch.
        flight.data, flight.error = (data if flight.wanted else None), error
        flight.done.set()

    # -- prefetch and fill ----------------------------------------------------------------

    def _prefetch(self, numbers: list[int]) -> None:
        for batch in batches(self.index, numbers, self.parallel * self.max_request_bytes):
            if self._stop.is_set():
                return
            missing = [n for n in batch if not self.cache.present(n)]
            if missing:
                self._fetch(missing, self.max_request_bytes, collect=False)

    def _fill_loop(self) -> None:
        request_bytes = max(1, self.max_request_bytes // self.parallel)
        try:
            order = [n for n in fill_order(self.index) if not self.cache.present(n)]
            for batch in batches(self.index, order, self.max_request_bytes):
                if not self._wait_until_no_foreground_fetch():
                    return
                missing = [n for n in batch if not self.cache.present(n)]
                fits = self._within_cache_room(missing)
                if fits:
                    self._fetch(fits, request_bytes, collect=False)
                if len(fits) < len(missing):
                    log.info("background fill of %s stops: the cache is full (max %s bytes)",
                             self.data_digest, self.cache.max_bytes)
                    return
            log.info("background fill of %s is done", self.data_digest)
        except OSError as exc:
            log.warning("background fill of %s stopped: %s (reads still fetch what they need)", self.data_digest, exc)

    def _within_cache_room(self, numbers: list[int]) -> list[int]:
        """The prefix of ``numbers`` that fits the cache without evicting (filling must not evict)."""
        room = self.cache.free_bytes()
        if room is None:
            return numbers
        fits = []
        for number in numbers:
            start, end = self.index.span(number)
            if end - start > room:
                break
            room -= end - start
            fits.append(number)
        return fits

    def _wait_until_no_foreground_fetch(self) -> bool:
        """Block while a read is fetching; False once close() has begun."""
        with self._idle:
            while self._foreground_fetching and not self._stop.is_set():
                self._idle.wait()
            return not self._stop.is_set()

    def _start_thread(self, thread: threading.Thread) -> None:
        with self._lock:
            if self._closed:
                raise OSError(errno.EBADF, "the lazy image is closed")
            self._threads.append(thread)
        thread.start()

    def _count(self, **increments: float) -> None:
        with self._lock:
            for name, value in increments.items():
                self._counts[name] += value

    def _check_open(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, "the lazy image is closed")


def open_lazy(registry: Registry, repo: str, index_digest: str, cache_root: Path, *,
              max_cache_bytes: int | None = None, **kwargs) -> LazyImage:
    """The image whose index blob is ``index_digest``, cached under ``cache_root/<data digest hex>``.

    ``RegistryError`` when the index blob cannot be had or does not match its digest,
    :class:`images.seekable.index.BadIndex` when it is not an index. ``kwargs`` go to
    :class:`LazyImage`.
    """
    body = registry.get_blob(repo, check_digest(index_digest))
    if sha256_digest(body) != index_digest:  # the Protocol promises this; a cheap second look
        raise RegistryError(f"index blob {index_digest} from {registry.url} has digest {sha256_digest(body)}")
    index = SectorIndex.from_json(body)
    data_hex = check_digest(index.data_digest).partition(":")[2]
    cache = SectorCache(Path(cache_root) / data_hex, index, max_bytes=max_cache_bytes)
    try:
        return LazyImage(registry, repo, index, cache, **kwargs)
    except BaseException:
        cache.close()
        raise
