"""Which Range requests fetch a set of sectors: the pure part of the lazy fetcher (no I/O).

A registry round trip costs far more than the bytes of one sector, so the fetcher asks for
sectors whose stored bytes sit next to each other in the data blob with one request. The
image builder writes non-hole sectors in ascending order with no gaps, so a sequential read
of the image becomes a few large requests rather than one per sector.

>>> from images.seekable.index import Sector, SectorIndex
>>> index = SectorIndex(5 * 4096, 4096, (Sector(0, 100, "zstd", "a" * 64), Sector(100, 50, "zstd", "b" * 64),
...                                      Sector(150, 0, "hole", ""), Sector(150, 70, "zstd", "c" * 64),
...                                      Sector(220, 4096, "raw", "d" * 64)))
>>> [(run.start, run.length, run.numbers) for run in plan_runs(index, [4, 0, 1, 2, 3], max_request_bytes=256)]
[(0, 220, (0, 1, 3)), (220, 4096, (4,))]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from images.seekable.index import SectorIndex


@dataclass(frozen=True)
class Run:
    """One Range request: ``length`` stored bytes from ``start``, holding ``numbers`` in order."""

    start: int
    length: int
    numbers: tuple[int, ...]


def plan_runs(index: SectorIndex, numbers: Iterable[int], max_request_bytes: int) -> list[Run]:
    """The requests that fetch the non-hole sectors among ``numbers``, by stored offset.

    Sectors join a run while their stored bytes start where the previous sector's end and the
    run stays within ``max_request_bytes``. A sector stored in more than ``max_request_bytes``
    gets a run of its own (a sector is never split: it is decoded and verified whole).

    >>> from images.seekable.index import Sector, SectorIndex
    >>> index = SectorIndex(3 * 4096, 4096, (Sector(0, 10, "raw", ""), Sector(10, 10, "raw", ""),
    ...                                      Sector(20, 10, "raw", "")))
    >>> [run.numbers for run in plan_runs(index, [0, 1, 2], max_request_bytes=20)]
    [(0, 1), (2,)]
    >>> [run.numbers for run in plan_runs(index, [0, 2], max_request_bytes=100)]  # a gap: two requests
    [(0,), (2,)]
    """
    stored = sorted({n for n in numbers if index.sectors[n].codec != "hole"}, key=lambda n: index.sectors[n].offset)
    runs: list[Run] = []
    current: list[int] = []
    start = end = 0
    for number in stored:
        sector = index.sectors[number]
        if current and sector.offset == end and end + sector.length - start <= max_request_bytes:
            current.append(number)
            end += sector.length
            continue
        if current:
            runs.append(Run(start, end - start, tuple(current)))
        current, start, end = [number], sector.offset, sector.offset + sector.length
    if current:
        runs.append(Run(start, end - start, tuple(current)))
    return runs


def batches(index: SectorIndex, numbers: Sequence[int], max_batch_bytes: int) -> Iterator[list[int]]:
    """``numbers`` in their order, cut into batches of at most ``max_batch_bytes`` stored bytes.

    Holes cost nothing and ride along; a batch always holds at least one sector.

    >>> from images.seekable.index import Sector, SectorIndex
    >>> index = SectorIndex(4 * 4096, 4096, (Sector(0, 60, "raw", ""), Sector(60, 60, "raw", ""),
    ...                                      Sector(120, 0, "hole", ""), Sector(120, 60, "raw", "")))
    >>> list(batches(index, [3, 2, 1, 0], max_batch_bytes=120))
    [[3, 2, 1], [0]]
    """
    batch: list[int] = []
    batch_bytes = 0
    for number in numbers:
        length = index.sectors[number].length
        if batch and batch_bytes + length > max_batch_bytes:
            yield batch
            batch, batch_bytes = [], 0
        batch.append(number)
        batch_bytes += length
    if batch:
        yield batch


def fill_order(index: SectorIndex) -> list[int]:
    """Every non-hole sector once: the recorded start-up order first, then ascending.

    >>> from images.seekable.index import Sector, SectorIndex
    >>> sectors = (Sector(0, 1, "raw", ""), Sector(1, 0, "hole", ""), Sector(1, 1, "raw", ""), Sector(2, 1, "raw", ""))
    >>> fill_order(SectorIndex(4 * 4096, 4096, sectors, prefetch=(3, 1, 3)))
    [3, 0, 2]
    """
    seen: set[int] = set()
    order: list[int] = []
    for number in [*index.prefetch, *range(len(index.sectors))]:
        if number not in seen and index.sectors[number].codec != "hole":
            seen.add(number)
            order.append(number)
    return order
