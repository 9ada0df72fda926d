"""The lazy fetcher serves the image's bytes, fetching each sector once, within its cache bound."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from images.lazy import LazyImage, SectorCache, open_lazy
from images.lazy.cache import BITMAP_FILE, DATA_FILE
from images.oci.fake import FakeRegistry
from images.oci.registry import RegistryError, sha256_digest
from tests.seekable_helpers import (CorruptingRegistry, FailingRegistry, GatedRegistry, WrappedRegistry,
                                    fetches_per_sector, image_bytes, push_seekable)

REPO = "models/demo"
SECTOR = 4096


def lazy(registry, index, directory: Path, *, max_bytes=None, punch_hole=None, **kwargs) -> LazyImage:
    cache_kwargs = {"punch_hole": punch_hole} if punch_hole else {}
    cache = SectorCache(directory, index, max_bytes=max_bytes, **cache_kwargs)
    kwargs.setdefault("sleep", lambda seconds: None)
    return LazyImage(registry, REPO, index, cache, **kwargs)


def random_image(sectors: int, sector_bytes: int = SECTOR, seed: int = 0) -> bytes:
    """Incompressible bytes: every sector stored raw, ``sector_bytes`` long, none a hole."""
    return random.Random(seed).randbytes(sectors * sector_bytes)


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# -- every read returns the image's bytes ---------------------------------------------------

segments = st.lists(st.tuples(st.sampled_from(["zeros", "random", "text"]), st.integers(1, 3 * 8192)),
                    min_size=1, max_size=8)
reads = st.lists(st.tuples(st.integers(0, 13 * 8192), st.integers(0, 3 * 8192)), min_size=1, max_size=12)


@settings(max_examples=40)
@given(segments=segments, seed=st.integers(0, 2**32), sector_bytes=st.sampled_from([4096, 8192]), reads=reads,
       mode=st.sampled_from(["empty cache", "warm cache", "background fill"]))
def test_reads_return_the_image_bytes_and_fetch_each_sector_once(segments, seed, sector_bytes, reads, mode):
    raw = image_bytes(segments, seed)
    registry = FakeRegistry()
    index, _ = push_seekable(registry, REPO, raw, sector_bytes, prefetch=tuple(range(len(raw) // sector_bytes))[::-2])
    with tempfile.TemporaryDirectory() as directory:
        if mode == "warm cache":
            with lazy(registry, index, Path(directory)) as image:
                image.read(0, len(raw))
            registry.range_requests.clear()
        with lazy(registry, index, Path(directory), parallel=3, max_request_bytes=2 * sector_bytes) as image:
            if mode == "background fill":
                image.start_background_fill()
            for offset, length in reads:
                assert image.read(offset, length) == raw[offset:offset + length]
    assert all(count == 1 for count in fetches_per_sector(registry, index).values())
    if mode == "warm cache":
        assert registry.range_requests == []


def test_a_read_past_the_end_is_empty_and_a_read_across_it_is_short():
    registry = FakeRegistry()
    raw = random_image(2)[:-100]
    index, _ = push_seekable(registry, REPO, raw, SECTOR)
    with tempfile.TemporaryDirectory() as directory, lazy(registry, index, Path(directory)) as image:
        assert image.size == len(raw)
        assert image.read(len(raw), 10) == b""
        assert image.read(len(raw) - 5, 10) == raw[-5:]
        with pytest.raises(OSError) as raised:
            image.read(-1, 10)
        assert raised.value.errno == errno.EINVAL


# -- requests ------------------------------------------------------------------------------

@pytest.mark.parametrize("max_request_bytes, expected_requests", [
    (8 * SECTOR, [(0, 8 * SECTOR)]),
    (3 * SECTOR, [(0, 3 * SECTOR), (3 * SECTOR, 3 * SECTOR), (6 * SECTOR, 2 * SECTOR)]),
    (SECTOR + 1, [(n * SECTOR, SECTOR) for n in range(8)]),
])
def test_adjacent_missing_sectors_share_a_request_of_at_most_max_request_bytes(max_request_bytes, expected_requests):
    registry = FakeRegistry()
    raw = random_image(8)
    index, _ = push_seekable(registry, REPO, raw, SECTOR)
    with tempfile.TemporaryDirectory() as directory, \
            lazy(registry, index, Path(directory), max_request_bytes=max_request_bytes) as image:
        assert image.read(0, len(raw)) == raw
        assert sorted((start, length) for _, start, length in registry.range_requests) == expected_requests
        assert image.stats().requests == len(expected_requests)


def test_holes_are_zeros_never_fetched_and_do_not_break_a_run():
    registry = FakeRegistry()
    raw = random_image(2) + bytes(2 * SECTOR) + random_image(1, seed=1)
    index, _ = push_seekable(registry, REPO, raw, SECTOR)
    assert [s.codec for s in index.sectors] == ["raw", "raw", "hole", "hole", "raw"]
    with tempfile.TemporaryDirectory() as directory, lazy(registry, index, Path(directory)) as image:
        assert image.read(2 * SECTOR, 2 * SECTOR) == bytes(2 * SECTOR)
        assert registry.range_requests == []
        assert image.read(0, len(raw)) == raw
        assert [(start, length) for _, start, length in registry.range_requests] == [(0, 3 * SECTOR)]


def test_a_cached_sector_splits_the_run_of_missing_ones():
    registry = FakeRegistry()
    raw = random_image(4)
    index, _ = push_seekable(registry, REPO, raw, SECTOR)
    with tempfile.TemporaryDirectory() as directory, lazy(registry, index, Path(directory)) as image:
        image.read(SECTOR, 1)
        image.read(0, len(raw))
        assert sorted((start, length) for _, start, length in registry.range_requests) == [
            (0, SECTOR), (SECTOR, SECTOR), (2 * SECTOR, 2 * SECTOR)]


def test_concurrent_readers_of_one_sector_wait_for_one_fetch():
    inner = FakeRegistry()
    raw = random_image(2)
    index, _ = push_seekable(inner, REPO, raw, SECTOR)
    registry = GatedRegistry(inner)
    results: list[bytes] = []
    with tempfile.TemporaryDirectory() as directory, lazy(registry, index, Path(directory)) as image:
        readers = [threading.Thread(target=lambda at=at: results.append(image.read(at, 100)))
                   for at in range(0, 800, 100)]
        for reader in readers:
            reader.start()
        wait_until(lambda: registry.entered >= 1)
        time.sleep(0.3)  # room for the other readers to (wrongly) ask the registry too
        assert registry.entered == 1
        registry.release.set()
        for reader in readers:
            reader.join(10)
        assert sorted(results) == sorted(raw[at:at + 100] for at in range(0, 800, 100))
        assert len(inner.range_requests) == 1


# -- failures ------------------------------------------------------------------------------

def test_a_corrupt_response_is_detected_and_only_that_sector_refetched():
    inner = FakeRegistry()
    raw = random_image(3)
    index, _ = push_seekable(inner, REPO, raw, SECTOR)
    registry = CorruptingRegistry(inner, bad_responses=1)
    with tempfile.TemporaryDirectory() as directory, lazy(registry, index, Path(directory)) as image:
        assert image.read(0, len(raw)) == raw
        assert [(start, length) for _, start, length in inner.range_requests] == [(0, 3 * SECTOR), (0, SECTOR)]
        assert image.stats().corrupt_refetches == 1


def test_a_persistently_corrupt_sector_is_eio_and_never_served():
    inner = FakeRegistry()
    raw = image_bytes([("text", 2 * SECTOR)], seed=3)
    index, _ = push_seekable(inner, REPO, raw, SECTOR)
    registry = CorruptingRegistry(inner, bad_responses=None)
    with tempfile.TemporaryDirectory() as directory, lazy(registry, index, Path(directory), retries=2) as image:
        for _ in range(2):
            with pytest.raises(OSError) as raised:
                image.read(0, 10)
            assert raised.value.errno == errno.EIO
            assert f"sector 0 of {index.data_digest}" in str(raised.value)
            assert "after 3 fetches" in str(raised.value)
        assert not image.cache.present(0)
    assert len(inner.range_requests) == 2 * 3


@pytest.mark.parametrize("failures, sleeps, succeeds", [
    (2, [0.2, 0.4], True),
    (None, [0.2, 0.4, 0.8], False),
])
def test_registry_errors_are_retried_with_backoff_then_eio(failures, sleeps, succeeds):
    inner = FakeRegistry()
    raw = random_image(1)
    index, _ = push_seekable(inner, REPO, raw, SECTOR)
    registry = FailingRegistry(inner, failures)
    slept: list[float] = []
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(image.read(0, SECTOR))
        except OSError as exc:
            outcome.append(exc)

    with tempfile.TemporaryDirectory() as directory, \
            lazy(registry, index, Path(directory), retries=3, backoff_s=0.2, sleep=slept.append) as image:
        reader = threading.Thread(target=read)
        reader.start()
        reader.join(10)
        assert not reader.is_alive()
    assert slept == pytest.approx(sleeps)
    if succeeds:
        assert outcome == [raw]
    else:
        [error] = outcome
        assert isinstance(error, OSError) and error.errno == errno.EIO
        assert registry.url in str(error) and "connection refused" in str(error)


class SlowFailures(FailingRegistry):
    """A stopped registry: each request fails after ``request_s`` of a fake clock."""

    def __init__(self, inner: FakeRegistry, clock: list[float], request_s: float) -> None:
        super().__init__(inner, None)
        self.clock, self.request_s = clock, request_s

    def read_blob_range(self, repo: str, digest: str, start: int, length: int) -> bytes:
        self.clock[0] += self.request_s
        return super().read_blob_range(repo, digest, start, length)


def test_a_read_gives_up_within_its_budget_and_reads_soon_after_fail_without_asking():
    """5 s a request and a 12 s budget: two attempts, then EIO; for down_hold_s later reads
    fail at once (the kernel retries page by page, and readers queue behind each other)."""
    inner, now = FakeRegistry(), [0.0]
    index, _ = push_seekable(inner, REPO, random_image(4), SECTOR)
    registry = SlowFailures(inner, now, request_s=5.0)

    def sleep(seconds: float) -> None:
        now[0] += seconds

    with tempfile.TemporaryDirectory() as directory, \
            lazy(registry, index, Path(directory), retries=3, backoff_s=0.2, read_budget_s=12.0, down_hold_s=2.0,
                 sleep=sleep, clock=lambda: now[0]) as image:
        with pytest.raises(OSError) as first:
            image.read(0, SECTOR)
        assert first.value.errno == errno.EIO and registry.attempts == 2 and now[0] == pytest.approx(10.2)
        with pytest.raises(OSError, match="not asked for until then") as soon:
            image.read(SECTOR, SECTOR)
        assert soon.value.errno == errno.EIO and registry.attempts == 2
        now[0] += 2.0
        with pytest.raises(OSError, match="after 2 attempts"):
            image.read(2 * SECTOR, SECTOR)
        assert registry.attempts == 4  # held off no longer: the registry is asked again


# -- the cache -----------------------------------------------------------------------------

def allocated_bytes(directory: Path) -> int:
    return os.stat(directory / DATA_FILE).st_blocks * 512


@contextlib.contextmanager
def warnings_of(name: str):
    """The messages one logger warns with, heard on that logger itself: what other tests did to
    the logging tree (a parent that no longer propagates, a logger disabled by a library's
    ``dictConfig``) cannot hide them. Once, in a full run, ``caplog`` heard nothing here."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(name)
    level, disabled = logger.level, logger.disabled
    logger.disabled = False
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled


@pytest.mark.parametrize("punching", ["works", "fails"])
def test_the_cache_stays_within_its_bound(punching):
    registry = FakeRegistry()
    sector_bytes = 16384
    raw = random_image(12, sector_bytes)
    index, _ = push_seekable(registry, REPO, raw, sector_bytes)
    max_bytes = 4 * sector_bytes

    def no_punching(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "not on this filesystem")

    rng = random.Random(5)
    with tempfile.TemporaryDirectory() as directory, warnings_of("modelplane.images.lazy") as warnings, \
            lazy(registry, index, Path(directory), max_bytes=max_bytes,
                 punch_hole=no_punching if punching == "fails" else None) as image:
        for _ in range(40):
            offset = rng.randrange(len(raw))
            length = rng.randrange(3 * sector_bytes)
            assert image.read(offset, length) == raw[offset:offset + length]
            assert len(image.cache.present_numbers()) * sector_bytes <= max_bytes
            assert allocated_bytes(Path(directory)) <= max_bytes + sector_bytes
        assert image.cache.present_numbers()
    assert any("caching no sectors beyond max_bytes" in m for m in warnings) == (punching == "fails")


def test_eviction_takes_the_least_recently_used_sector():
    raw = random_image(4)
    index, _ = push_seekable(FakeRegistry(), REPO, raw, SECTOR)
    with tempfile.TemporaryDirectory() as directory:
        cache = SectorCache(Path(directory), index, max_bytes=3 * SECTOR)
        for number in range(3):
            assert cache.put(number, raw[number * SECTOR:(number + 1) * SECTOR])
        assert cache.get(0) == raw[:SECTOR]
        assert cache.put(3, raw[3 * SECTOR:])
        assert sorted(cache.present_numbers()) == [0, 2, 3]
        assert not cache.put_many({n: raw[n * SECTOR:(n + 1) * SECTOR] for n in range(4)}) >= {0, 1, 2, 3}
        assert cache.used_bytes <= 3 * SECTOR
        cache.close()


def test_one_cache_directory_serves_one_reader_at_a_time():
    index, _ = push_seekable(FakeRegistry(), REPO, random_image(1), SECTOR)
    with tempfile.TemporaryDirectory() as directory:
        cache = SectorCache(Path(directory), index)
        with pytest.raises(OSError) as raised:
            SectorCache(Path(directory), index)
        assert raised.value.errno == errno.EBUSY
        cache.close()
        SectorCache(Path(directory), index).close()


def test_a_restarted_image_reads_everything_from_the_persisted_cache():
    registry = FakeRegistry()
    raw = image_bytes([("text", 3 * SECTOR), ("zeros", SECTOR), ("random", 2 * SECTOR)], seed=4)
    index, _ = push_seekable(registry, REPO, raw, SECTOR)
    with tempfile.TemporaryDirectory() as directory:
        with lazy(registry, index, Path(directory)) as image:
            image.read(0, len(raw))
        assert (Path(directory) / BITMAP_FILE).exists()
        registry.range_requests.clear()
        with lazy(registry, index, Path(directory)) as image:
            assert image.read(SECTOR + 7, 2 * SECTOR) == raw[SECTOR + 7:3 * SECTOR + 7]
            assert image.read(0, len(raw)) == raw
            assert image.read(SECTOR + 7, 2 * SECTOR) == raw[SECTOR + 7:3 * SECTOR + 7]
            assert image.stats().sectors_from_cache == 2 + 5 + 2  # sector 3 is a hole: never cached
        assert registry.range_requests == []


def test_a_cached_sector_damaged_on_disk_is_fetched_again_not_served():
    registry = FakeRegistry()
    raw = random_image(3)
    index, _ = push_seekable(registry, REPO, raw, SECTOR)
    with tempfile.TemporaryDirectory() as directory:
        with lazy(registry, index, Path(directory)) as image:
            image.read(0, len(raw))
        with open(Path(directory) / DATA_FILE, "r+b") as cached:  # a torn write of sector 1
            cached.seek(SECTOR + 10)
            cached.write(b"\0" * 100)
        registry.range_requests.clear()
        with lazy(registry, index, Path(directory)) as image:
            assert image.read(0, len(raw)) == raw
        assert [(start, length) for _, start, length in registry.range_requests] == [(SECTOR, SECTOR)]


def test_a_cache_directory_of_another_image_starts_empty():
    registry = FakeRegistry()
    first, _ = push_seekable(registry, REPO, random_image(2, seed=1), SECTOR)
    second_raw = random_image(2, seed=2)
    second, _ = push_seekable(registry, REPO, second_raw, SECTOR)
    with tempfile.TemporaryDirectory() as directory:
        with lazy(registry, first, Path(directory)) as image:
            image.read(0, 2 * SECTOR)
        with lazy(registry, second, Path(directory)) as image:
            assert image.cache.present_numbers() == []
            assert image.read(0, 2 * SECTOR) == second_raw


# -- prefetch, background fill, access log ---------------------------------------------------

def test_prefetch_fetches_in_the_given_order_and_reads_then_hit_the_cache():
    registry = FakeRegistry()
    raw = random_image(8)
    index, _ = push_seekable(registry, REPO, raw, SECTOR)
    with tempfile.TemporaryDirectory() as directory, \
            lazy(registry, index, Path(directory), parallel=1, max_request_bytes=SECTOR) as image:
        image.prefetch([5, 2, 7])
        assert [start // SECTOR for _, start, _ in registry.range_requests] == [5, 2, 7]
        assert image.read(2 * SECTOR, SECTOR) == raw[2 * SECTOR:3 * SECTOR]
        assert len(registry.range_requests) == 3
        assert image.access_log() == [2]


def test_the_access_log_is_first_touch_order_of_reads():
    registry = FakeRegistry()
    raw = random_image(6)
    index, _ = push_seekable(registry, REPO, raw, SECTOR)
    with tempfile.TemporaryDirectory() as directory, lazy(registry, index, Path(directory)) as image:
        image.prefetch([0])
        for offset in [3 * SECTOR, SECTOR + 5, 3 * SECTOR, 4 * SECTOR - 1]:
            image.read(offset, 2)
        assert image.access_log() == [3, 1, 4]


def test_background_fill_fetches_everything_start_up_order_first():
    registry = FakeRegistry()
    raw = random_image(6)
    index, _ = push_seekable(registry, REPO, raw, SECTOR, prefetch=(4, 1))
    with tempfile.TemporaryDirectory() as directory, \
            lazy(registry, index, Path(directory), parallel=1, max_request_bytes=SECTOR) as image:
        image.start_background_fill()
        wait_until(lambda: all(image.cache.present(n) for n in range(6)))
        assert [start // SECTOR for _, start, _ in registry.range_requests] == [4, 1, 0, 2, 3, 5]
        assert image.read(0, len(raw)) == raw
        assert image.access_log() == list(range(6))
        assert len(registry.range_requests) == 6


def test_background_fill_waits_while_a_read_is_fetching_and_close_stops_it():
    inner = FakeRegistry()
    raw = random_image(6)
    index, _ = push_seekable(inner, REPO, raw, SECTOR)
    registry = GatedRegistry(inner)
    with tempfile.TemporaryDirectory() as directory:
        image = lazy(registry, index, Path(directory), parallel=2, max_request_bytes=SECTOR)
        reader = threading.Thread(target=image.read, args=(5 * SECTOR, 10))
        reader.start()
        wait_until(lambda: registry.entered == 1)
        image.start_background_fill()
        time.sleep(0.3)  # room for the fill to (wrongly) start a request while the read is fetching
        assert registry.entered == 1
        registry.release.set()
        reader.join(10)
        wait_until(lambda: len(inner.range_requests) >= 2)
        image.close()
        image.close()
        assert not any(t.name == "lazy-fill" and t.is_alive() for t in threading.enumerate())
        with pytest.raises(OSError):
            image.read(0, 1)


# -- open_lazy -----------------------------------------------------------------------------

def test_open_lazy_finds_the_index_by_digest_and_keys_the_cache_by_data_digest(tmp_path):
    registry = FakeRegistry()
    raw = image_bytes([("text", 5000), ("zeros", 9000), ("random", 3000)], seed=6)
    index, index_digest = push_seekable(registry, REPO, raw, SECTOR)
    with open_lazy(registry, REPO, index_digest, tmp_path, max_cache_bytes=1 << 20, parallel=2) as image:
        assert image.read(0, len(raw)) == raw
        assert image.cache.directory == tmp_path / index.data_digest.removeprefix("sha256:")


def test_open_lazy_refuses_a_wrong_or_tampered_index(tmp_path):
    registry = FakeRegistry()
    _, index_digest = push_seekable(registry, REPO, random_image(1), SECTOR)
    with pytest.raises(RegistryError):
        open_lazy(registry, REPO, sha256_digest(b"another index"), tmp_path)

    class Tampering(WrappedRegistry):
        def get_blob(self, repo: str, digest: str) -> bytes:
            return self.inner.get_blob(repo, digest).replace(b'"image_size":4096', b'"image_size":4095')

    with pytest.raises(RegistryError):
        open_lazy(Tampering(registry), REPO, index_digest, tmp_path)
