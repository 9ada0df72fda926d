"""The index of a seekable image: where each sector of the filesystem image is stored.

A filesystem image (squashfs by default) of ``image_size`` bytes is cut into sectors of
``sector_bytes`` (4 MiB by default; the last may be shorter). Each sector is stored on its own
in the data blob: zstd-compressed, raw where compression does not help, or not at all (a
hole) where it is all zeros. ``sha256`` is the digest of the sector's *uncompressed* bytes,
checked after decompression, before a byte is used. ``prefetch`` lists the sectors the
runtime reads while it starts, in the order it read them.

The index is a JSON blob of its own; a reader needs nothing else to find any byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARTIFACT_TYPE = "application/vnd.modelplane.seekable.v1"
INDEX_MEDIA_TYPE = "application/vnd.modelplane.seekable.index.v1+json"
DATA_MEDIA_TYPE = "application/vnd.modelplane.seekable.sectors.v1"
CODECS = ("zstd", "raw", "hole")
DEFAULT_SECTOR_BYTES = 4 << 20
FORMAT_VERSION = 1


class BadIndex(ValueError):
    """A malformed index: the message says which field."""


@dataclass(frozen=True)
class Sector:
    offset: int  # where its stored bytes start in the data blob
    length: int  # stored bytes (0 for a hole)
    codec: str  # zstd | raw | hole
    sha256: str  # hex digest of the uncompressed sector


@dataclass(frozen=True)
class SectorIndex:
    image_size: int
    sector_bytes: int
    sectors: tuple[Sector, ...]
    prefetch: tuple[int, ...] = ()
    filesystem: str = "squashfs"
    data_digest: str = ""  # the data blob's OCI digest

    def span(self, number: int) -> tuple[int, int]:
        """[start, end) of sector ``number`` in the filesystem image.

        >>> SectorIndex(10, 4, (Sector(0, 4, "raw", ""),) * 3).span(2)
        (8, 10)
        """
        start = number * self.sector_bytes
        return start, min(start + self.sector_bytes, self.image_size)

    def covering(self, offset: int, length: int) -> range:
        """The sector numbers a read of ``length`` bytes at ``offset`` touches.

        >>> list(SectorIndex(10, 4, (Sector(0, 4, "raw", ""),) * 3).covering(3, 2))
        [0, 1]
        """
        end = min(offset + length, self.image_size)
        if end <= offset:
            return range(0)
        return range(offset // self.sector_bytes, (end - 1) // self.sector_bytes + 1)

    def to_json(self) -> bytes:
        return json.dumps({
            "version": FORMAT_VERSION, "filesystem": self.filesystem, "image_size": self.image_size,
            "sector_bytes": self.sector_bytes, "data_digest": self.data_digest, "prefetch": list(self.prefetch),
            "sectors": [[s.offset, s.length, s.codec, s.sha256] for s in self.sectors],
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, body: bytes) -> SectorIndex:
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadIndex(f"the seekable index is not JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise BadIndex(f"the seekable index is not version {FORMAT_VERSION} of the format")
        try:
            sectors = tuple(Sector(int(o), int(n), str(c), str(d)) for o, n, c, d in data["sectors"])
            index = cls(int(data["image_size"]), int(data["sector_bytes"]), sectors,
                        tuple(int(i) for i in data.get("prefetch", ())), str(data.get("filesystem", "squashfs")),
                        str(data.get("data_digest", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadIndex(f"the seekable index is missing or mistypes a field: {exc!r}") from None
        index.validate()
        return index

    def validate(self) -> None:
        if self.sector_bytes <= 0 or self.sector_bytes % 4096:
            raise BadIndex(f"sector_bytes {self.sector_bytes} is not a positive multiple of 4096")
        expected = -(-self.image_size // self.sector_bytes)
        if len(self.sectors) != expected:
            raise BadIndex(f"{len(self.sectors)} sectors for an image of {self.image_size} bytes "
                              f"in {self.sector_bytes}-byte sectors (expected {expected})")
        for number, sector in enumerate(self.sectors):
            if sector.codec not in CODECS:
                raise BadIndex(f"sector {number} has codec {sector.codec!r}; known: {', '.join(CODECS)}")
            if sector.offset < 0 or sector.length < 0 or (sector.codec == "hole") != (sector.length == 0):
                raise BadIndex(f"sector {number} has offset {sector.offset}, length {sector.length} "
                                  f"and codec {sector.codec}")
            if sector.codec != "hole" and len(sector.sha256) != 64:
                raise BadIndex(f"sector {number} has no sha256 digest")
        bad = [i for i in self.prefetch if not 0 <= i < len(self.sectors)]
        if bad:
            raise BadIndex(f"prefetch names sectors {bad[:5]} outside 0..{len(self.sectors) - 1}")
