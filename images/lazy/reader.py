"""A lazy image's reads from the registry: stored bytes of its data blob by HTTP Range, each
request retried with exponential backoff within a time budget, and a sector fetched again on its
own until it matches its digest. Used by :class:`images.lazy.fetcher.LazyImage`, whose
docstring gives the guarantees (right bytes or EIO, never a hang; a failed registry holds reads
off for ``down_hold_s``)."""

from __future__ import annotations

import errno
from collections.abc import Callable

from images.oci.registry import NotFound, Registry, RegistryError, check_digest
from images.seekable.codec import SectorCorrupt, decode_sector
from images.seekable.index import SectorIndex


class SectorReader:
    """Stored bytes and sectors of ``index``'s data blob in ``repo``; ``count`` is told of each
    request (``requests``, ``bytes_fetched``) and each refetch (``corrupt_refetches``)."""

    def __init__(self, registry: Registry, repo: str, index: SectorIndex, *, retries: int, backoff_s: float,
                 read_budget_s: float, down_hold_s: float, sleep: Callable[[float], None],
                 clock: Callable[[], float], count: Callable[..., None]) -> None:
        self.registry, self.repo, self.index = registry, repo, index
        self.data_digest = check_digest(index.data_digest)
        self.retries, self.backoff_s = retries, backoff_s
        self.read_budget_s, self.down_hold_s = read_budget_s, down_hold_s
        self._sleep, self._clock, self._count = sleep, clock, count
        self._down_until = float("-inf")  # registry reads fail at once until then (set by a failed read)

    def refetch(self, number: int) -> bytes:
        """Sector ``number`` alone, up to ``retries`` more times, until it matches its digest."""
        sector = self.index.sectors[number]
        start, end = self.index.span(number)
        for _ in range(self.retries):
            self._count(corrupt_refetches=1)
            try:
                return decode_sector(sector, self.read_range(sector.offset, sector.length), end - start, number)
            except SectorCorrupt:
                continue
        raise OSError(errno.EIO, f"sector {number} of {self.data_digest} from registry {self.registry.url} "
                                 f"does not match its digest after {self.retries + 1} fetches")

    def read_range(self, start: int, length: int) -> bytes:
        """Stored bytes from the registry, retried with backoff; OSError(EIO) when it keeps failing."""
        started = self._clock()
        if started < self._down_until:
            raise OSError(errno.EIO, f"registry {self.registry.url} failed a read less than {self.down_hold_s:g} s "
                                     f"ago; bytes {start}+{length} of {self.data_digest} are not asked for until then")
        failure: Exception | None = None
        attempts = 0
        for attempt in range(self.retries + 1):
            attempts += 1
            attempt_started = self._clock()
            try:
                data = self.registry.read_blob_range(self.repo, self.data_digest, start, length)
            except NotFound as exc:  # the blob is gone: asking again will not bring it back
                raise OSError(errno.EIO, f"registry {self.registry.url} no longer has {self.data_digest} "
                                         f"in {self.repo}: {exc}") from exc
            except (RegistryError, OSError) as exc:
                failure = exc
                # another attempt only if, as long as this one, it would end within the budget
                delay, now = self.backoff_s * 2 ** attempt, self._clock()
                if attempt == self.retries or now - started + delay + (now - attempt_started) > self.read_budget_s:
                    break
                self._sleep(delay)
                continue
            self._count(requests=1, bytes_fetched=len(data))
            return data
        self._down_until = self._clock() + self.down_hold_s
        raise OSError(errno.EIO, f"registry {self.registry.url} failed to return bytes {start}+{length} of "
                                 f"{self.data_digest} after {attempts} attempts in {self._clock() - started:.1f} s: "
                                 f"{failure}") from failure
