"""One sector, stored and read back: the pure part of the format (no I/O).

>>> codec, stored, digest = encode_sector(b"a" * 8192)
>>> codec, len(stored) < 8192, decode_sector(Sector(0, len(stored), codec, digest), stored, 8192) == b"a" * 8192
('zstd', True, True)
>>> encode_sector(bytes(8192))[:2]
('hole', b'')
"""

from __future__ import annotations

import hashlib

from backports import zstd

from images.seekable.index import Sector


class SectorCorrupt(Exception):
    """Stored bytes that do not decode to the digest the index gives."""

    def __init__(self, number: int | None, reason: str) -> None:
        super().__init__(f"sector {number if number is not None else '?'}: {reason}")
        self.number = number


def encode_sector(raw: bytes, level: int = 3) -> tuple[str, bytes, str]:
    """(codec, stored bytes, sha256 hex of ``raw``): a hole when all zeros, raw when zstd does not help."""
    digest = hashlib.sha256(raw).hexdigest()
    if not raw.strip(b"\0"):
        return "hole", b"", digest
    packed = zstd.compress(raw, level=level)
    if len(packed) >= len(raw):
        return "raw", raw, digest
    return "zstd", packed, digest


def decode_sector(sector: Sector, stored: bytes, size: int, number: int | None = None) -> bytes:
    """The sector's ``size`` uncompressed bytes, its digest checked; SectorCorrupt otherwise."""
    if sector.codec == "hole":
        return bytes(size)
    if len(stored) != sector.length:
        raise SectorCorrupt(number, f"{len(stored)} stored bytes, the index says {sector.length}")
    if sector.codec == "raw":
        raw = stored
    else:
        try:
            raw = zstd.decompress(stored)
        except zstd.ZstdError as exc:
            raise SectorCorrupt(number, f"not a zstd frame ({exc})") from None
    if len(raw) != size or hashlib.sha256(raw).hexdigest() != sector.sha256:
        raise SectorCorrupt(number, "digest mismatch")
    return raw
