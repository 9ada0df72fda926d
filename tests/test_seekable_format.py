"""The seekable block format: squashfs image, sectors, extents, prefetch order."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from images.seekable.build import (COMPRESSIONS, SectorCorrupt, build_seekable, cut_sectors, make_filesystem,
                                   read_sector)
from images.seekable.extents import file_extents, metadata_ranges, prefetch_order
from images.seekable.index import Sector, SectorIndex
from images.source import FileSource

needs_mksquashfs = pytest.mark.skipif(shutil.which("mksquashfs") is None, reason="squashfs-tools not installed")
SECTOR_BYTES = 64 << 10


def random_bytes(length: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(length)


def cut(tmp_path: Path, image_bytes: bytes, sector_bytes: int) -> tuple[SectorIndex, bytes]:
    (tmp_path / "image").write_bytes(image_bytes)
    index = cut_sectors(tmp_path / "image", tmp_path / "data", sector_bytes=sector_bytes)
    return index, (tmp_path / "data").read_bytes()


def read_all(index: SectorIndex, data: bytes) -> bytes:
    return b"".join(read_sector(index, n, data[s.offset:s.offset + s.length]) for n, s in enumerate(index.sectors))


segment = st.one_of(
    st.integers(1, 20000).map(bytes),  # a zero run
    st.tuples(st.integers(1, 20000), st.integers(0, 2**32)).map(lambda a: random_bytes(*a)),  # incompressible
    st.tuples(st.binary(min_size=1, max_size=16), st.integers(1, 4000)).map(lambda a: a[0] * a[1]),  # compressible
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(segments=st.lists(segment, max_size=8), sector_pages=st.integers(1, 5))
def test_every_sector_reads_back_to_the_image_bytes(segments, sector_pages):
    image_bytes = b"".join(segments)
    with tempfile.TemporaryDirectory() as scratch:
        index, data = cut(Path(scratch), image_bytes, sector_pages * 4096)
    assert index.image_size == len(image_bytes)
    assert read_all(index, data) == image_bytes
    assert index.data_digest == "sha256:" + hashlib.sha256(data).hexdigest()
    assert sum(s.length for s in index.sectors) == len(data)  # stored back to back, nothing else
    assert SectorIndex.from_json(index.to_json()) == index


@pytest.mark.parametrize(("content", "codec"), [
    (bytes(8192), "hole"),
    (random_bytes(8192, 1), "raw"),
    (b"weights " * 1024, "zstd"),
])
def test_each_sector_is_stored_the_cheapest_way(tmp_path, content, codec):
    index, data = cut(tmp_path, content, 8192)
    (sector,) = index.sectors
    assert sector.codec == codec
    assert {"hole": sector.length == 0, "raw": data == content, "zstd": 0 < len(data) < len(content)}[codec]
    assert sector.sha256 == hashlib.sha256(content).hexdigest()


def test_a_short_last_sector_and_holes_in_the_middle(tmp_path):
    image_bytes = random_bytes(4096, 2) + bytes(8192) + b"tail" * 10
    index, data = cut(tmp_path, image_bytes, 4096)
    assert [s.codec for s in index.sectors] == ["raw", "hole", "hole", "zstd"]
    assert index.span(3) == (12288, 12328)
    assert read_all(index, data) == image_bytes


@pytest.mark.parametrize("content", [random_bytes(8192, 3), b"model " * 2000])
def test_a_flipped_stored_byte_is_caught(tmp_path, content):
    index, data = cut(tmp_path, bytes(4096) + content, 4096)
    for number, sector in enumerate(index.sectors):
        if sector.codec == "hole":
            continue
        stored = bytearray(data[sector.offset:sector.offset + sector.length])
        stored[len(stored) // 2] ^= 0x01
        with pytest.raises(SectorCorrupt) as caught:
            read_sector(index, number, bytes(stored))
        assert caught.value.number == number


def test_truncated_stored_bytes_are_caught(tmp_path):
    index, data = cut(tmp_path, b"model " * 2000, 16384)
    with pytest.raises(SectorCorrupt):
        read_sector(index, 0, data[:-1])


@pytest.mark.parametrize("sector_bytes", [0, -4096, 1000, 4097, 6144])
def test_sector_bytes_must_be_whole_pages(tmp_path, sector_bytes):
    (tmp_path / "image").write_bytes(b"x")
    with pytest.raises(ValueError, match="multiple of 4096"):
        cut_sectors(tmp_path / "image", tmp_path / "data", sector_bytes=sector_bytes)


def test_cutting_is_deterministic(tmp_path):
    image_bytes = random_bytes(50000, 4) + bytes(70000) + b"abc" * 30000
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    assert cut(tmp_path / "a", image_bytes, 16384) == cut(tmp_path / "b", image_bytes, 16384)


def make_tree(root: Path) -> Path:
    """Files bigger than a 4 KiB block (their data are blocks, not fragments) and small ones."""
    for name, size, seed in [("bin/app", 40000, 1), ("lib/big.so", 60000, 2), ("model/weights.bin", 90000, 3),
                             ("model/config with spaces.json", 9000, 4), ("#hash/tok", 20000, 5),
                             ("etc/small.conf", 300, 6), ("etc/other.conf", 500, 7)]:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(random_bytes(size, seed))
    os.symlink("app", root / "bin" / "app-link")
    return root


@needs_mksquashfs
def test_the_same_tree_gives_the_same_image(tmp_path):
    first = ["model/weights.bin", "bin/app"]
    make_tree(tmp_path / "one")
    shutil.copytree(tmp_path / "one", tmp_path / "two", symlinks=True)
    for name in ("one", "two"):
        make_filesystem(tmp_path / name, tmp_path / f"{name}.img", first=first, block_bytes=4096, processors=2)
    again = make_filesystem(tmp_path / "one", tmp_path / "again.img", first=first, block_bytes=4096, processors=1)
    assert (tmp_path / "one.img").read_bytes() == (tmp_path / "two.img").read_bytes() == again.read_bytes()


@needs_mksquashfs
@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_files_read_at_start_up_are_laid_out_first(tmp_path, compression):
    root = make_tree(tmp_path / "tree")
    first = ["model/config with spaces.json", "#hash/tok", "/bin/app"]
    image = make_filesystem(root, tmp_path / "image", first=first, compression=compression, block_bytes=4096)
    others = ["lib/big.so", "model/weights.bin"]
    extents = file_extents(image, first + others)
    starts = [extents[path][0][0] for path in first]
    assert starts == sorted(starts)  # in the order given
    assert max(end for path in first for _, end in extents[path]) <= min(extents[path][0][0] for path in others)
    assert starts[0] < 4096  # right after the superblock


@needs_mksquashfs
def test_extents_of_an_uncompressed_image_hold_the_files_bytes(tmp_path):
    root = make_tree(tmp_path / "tree")
    sparse = random_bytes(4096, 8) + bytes(4096) + random_bytes(4096, 9) + b"end"  # a zero block: sparse
    (root / "sparse.bin").write_bytes(sparse)
    image = make_filesystem(root, tmp_path / "image", compression="none", block_bytes=4096)
    paths = ["bin/app", "model/weights.bin", "etc/small.conf", "etc/other.conf", "#hash/tok", "sparse.bin"]
    image_bytes = image.read_bytes()
    for path, extents in file_extents(FileSource(image), paths).items():
        stored = b"".join(image_bytes[start:end] for start, end in extents)
        expected = (root / path).read_bytes() if path != "sparse.bin" else sparse[:4096] + sparse[8192:]
        assert stored == expected, path


@needs_mksquashfs
def test_extents_of_what_is_not_a_regular_file(tmp_path):
    image = make_filesystem(make_tree(tmp_path / "tree"), tmp_path / "image", block_bytes=4096)
    assert file_extents(image, ["bin", "bin/app-link", "not/here", "bin/app/under-a-file"]) == {
        "bin": [], "bin/app-link": []}


@needs_mksquashfs
def test_extents_through_linked_directories_and_dot_dot_are_the_targets(tmp_path):
    root = make_tree(tmp_path / "tree")
    os.symlink("model", root / "weights-dir")  # relative, to a directory
    os.symlink("/etc", root / "lib" / "etc-abs")  # absolute: from the image's root
    image = make_filesystem(root, tmp_path / "image", block_bytes=4096)
    extents = file_extents(image, ["model/weights.bin", "weights-dir/weights.bin", "lib/etc-abs/small.conf",
                                   "etc/small.conf", "lib/../model/weights.bin", "/bin/./app", "bin/app",
                                   "weights-dir/missing", "etc/small.conf/under-a-file"])
    assert extents["weights-dir/weights.bin"] == extents["model/weights.bin"] == extents["lib/../model/weights.bin"]
    assert extents["lib/etc-abs/small.conf"] == extents["etc/small.conf"]
    assert extents["/bin/./app"] == extents["bin/app"]
    assert "weights-dir/missing" not in extents and "etc/small.conf/under-a-file" not in extents


@needs_mksquashfs
def test_metadata_is_the_superblock_and_the_tables(tmp_path):
    image = make_filesystem(make_tree(tmp_path / "tree"), tmp_path / "image", block_bytes=4096)
    ranges = metadata_ranges(image)
    with FileSource(image) as source:
        assert metadata_ranges(source) == ranges
    data_end = max(end for extents in file_extents(image, ["bin/app", "lib/big.so"]).values() for _, end in extents)
    assert ranges[0] == (0, 96 + 6)  # the superblock, then zstd's options (the level we set)
    assert data_end <= ranges[1][0] < ranges[1][1] <= image.stat().st_size


def test_prefetch_lists_each_sector_once_in_first_touch_order():
    index = SectorIndex(10 * 4096, 4096, tuple(Sector(n, 1, "raw", "0" * 64) for n in range(10)))
    assert prefetch_order(index, [(0, 96), (36000, 36100), (4000, 9000), (36864, 40960), (0, 10)]) == (0, 8, 1, 2, 9)
    assert prefetch_order(index, []) == ()


@needs_mksquashfs
def test_a_build_prefetches_metadata_then_start_up_files(tmp_path):
    root = make_tree(tmp_path / "tree")
    built = build_seekable(root, tmp_path / "out", first=["model/weights.bin"], block_bytes=4096, sector_bytes=16384)
    index = built.index
    last = len(index.sectors) - 1
    assert index.prefetch[0] == 0 and last in index.prefetch  # superblock, then the tables at the end
    weights_sectors = {n for s, e in file_extents(built.image_path, ["model/weights.bin"])["model/weights.bin"]
                       for n in index.covering(s, e - s)}
    assert weights_sectors <= set(index.prefetch)
    data = built.data_path.read_bytes()
    assert read_all(index, data) == built.image_path.read_bytes()


def test_unknown_compression_lists_the_accepted_ones(tmp_path):
    with pytest.raises(ValueError, match="accepted: " + ", ".join(COMPRESSIONS)):
        make_filesystem(tmp_path, tmp_path / "image", compression="brotli")


def test_missing_mksquashfs_names_the_debian_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="squashfs-tools"):
        make_filesystem(tmp_path, tmp_path / "image")


@pytest.mark.parametrize("path", ["../outside", "a/../../outside", "line\nbreak"])
def test_start_up_paths_stay_inside_the_tree(tmp_path, path):
    with pytest.raises(ValueError):
        make_filesystem(tmp_path, tmp_path.parent / "image", first=[path])
