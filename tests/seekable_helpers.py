"""Seekable images built from bytes in memory, and registries that misbehave on purpose."""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import replace

from images.oci.fake import FakeRegistry
from images.oci.registry import RegistryError
from images.seekable.codec import encode_sector
from images.seekable.index import Sector, SectorIndex


def build_seekable(raw: bytes, sector_bytes: int, prefetch: tuple[int, ...] = ()) -> tuple[SectorIndex, bytes]:
    """(index without a data digest, data blob) of ``raw`` cut into ``sector_bytes`` sectors."""
    sectors, blob = [], bytearray()
    for start in range(0, len(raw), sector_bytes):
        codec, stored, digest = encode_sector(raw[start:start + sector_bytes], level=1)
        sectors.append(Sector(len(blob), len(stored), codec, digest))
        blob += stored
    return SectorIndex(len(raw), sector_bytes, tuple(sectors), tuple(prefetch)), bytes(blob)


def push_seekable(registry: FakeRegistry, repo: str, raw: bytes, sector_bytes: int,
                  prefetch: tuple[int, ...] = ()) -> tuple[SectorIndex, str]:
    """Push the data blob and the index blob; returns (index, index digest)."""
    index, blob = build_seekable(raw, sector_bytes, prefetch)
    data_digest, _ = registry.push_blob(repo, blob)
    index = replace(index, data_digest=data_digest)
    index_digest, _ = registry.push_blob(repo, index.to_json())
    return index, index_digest


def image_bytes(segments: list[tuple[str, int]], seed: int) -> bytes:
    """Concatenated segments: ``zeros`` (holes), ``random`` (stored raw) or ``text`` (zstd)."""
    rng = random.Random(seed)
    out = bytearray()
    for kind, length in segments:
        if kind == "zeros":
            out += bytes(length)
        elif kind == "random":
            out += rng.randbytes(length)
        else:
            words = [b"model", b"plane", b"sector", b"\n", b"weights", b" "]
            while length > 0:
                word = rng.choice(words)[:length]
                out += word
                length -= len(word)
    return bytes(out)


def fetches_per_sector(registry: FakeRegistry, index: SectorIndex) -> Counter[int]:
    """How many Range requests on the data blob covered each sector's stored bytes."""
    counts: Counter[int] = Counter()
    for digest, start, length in registry.range_requests:
        if digest != index.data_digest:
            continue
        for number, sector in enumerate(index.sectors):
            if sector.codec != "hole" and start <= sector.offset and sector.offset + sector.length <= start + length:
                counts[number] += 1
    return counts


class WrappedRegistry:
    """A FakeRegistry with ``read_blob_range`` open to change; everything else passes through."""

    def __init__(self, inner: FakeRegistry) -> None:
        self.inner = inner
        self.url = inner.url

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read_blob_range(self, repo: str, digest: str, start: int, length: int) -> bytes:
        return self.inner.read_blob_range(repo, digest, start, length)


class GatedRegistry(WrappedRegistry):
    """Every range request waits until ``release`` is set; ``entered`` counts them as they arrive."""

    def __init__(self, inner: FakeRegistry) -> None:
        super().__init__(inner)
        self.release = threading.Event()
        self.entered = 0
        self._lock = threading.Lock()

    def read_blob_range(self, repo: str, digest: str, start: int, length: int) -> bytes:
        with self._lock:
            self.entered += 1
        assert self.release.wait(10), "the test never released the registry"
        return super().read_blob_range(repo, digest, start, length)


class CorruptingRegistry(WrappedRegistry):
    """Flips one byte in the first ``bad_responses`` answers (all of them with None)."""

    def __init__(self, inner: FakeRegistry, bad_responses: int | None = 1) -> None:
        super().__init__(inner)
        self.bad_responses = bad_responses
        self.answered = 0

    def read_blob_range(self, repo: str, digest: str, start: int, length: int) -> bytes:
        data = bytearray(super().read_blob_range(repo, digest, start, length))
        self.answered += 1
        if self.bad_responses is None or self.answered <= self.bad_responses:
            data[0] ^= 0xFF
        return bytes(data)


class FailingRegistry(WrappedRegistry):
    """Raises ``RegistryError`` (no answer, as from a stopped registry) for the first ``failures`` requests."""

    def __init__(self, inner: FakeRegistry, failures: int | None = None) -> None:
        super().__init__(inner)
        self.failures = failures
        self.attempts = 0

    def read_blob_range(self, repo: str, digest: str, start: int, length: int) -> bytes:
        self.attempts += 1
        if self.failures is None or self.attempts <= self.failures:
            raise RegistryError(f"connection refused by {self.url}", 0)
        return super().read_blob_range(repo, digest, start, length)
