"""The front ends over a squashfs image: every one of them returns the image's bytes.

A random tree (nested directories, empty files, files on both sides of the 128 KiB squashfs
block size, a few MB of incompressible data, a sparse file, symlinks) goes through
``mksquashfs``; then the pure-Python reader, the FUSE directory view and the kernel path
(FUSE file, read-only loop device, kernel squashfs) must each give back the same listing,
the same link targets and the same bytes at any offset and length. A source that cannot
deliver some bytes gives readers EIO, never wrong bytes. Teardown leaves no mount, no loop
device and no daemon, also with a busy target or a set-up that failed halfway.

The kernel cases skip, saying why, where :func:`kernel_paths_available` says no; the
pure-Python cases always run.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from images.mount import (FuseProcess, FuseProcessConfig, LoopMount, LoopMountConfig, MountConfig, MountError,
                          NotSquashfsError, SourceFile, SquashReader, UnreadableRanges, fuse_available,
                          kernel_paths_available, mount_image)
from images.mount.system import loop_backing_file
from images.source import FileSource

BLOCK = 128 * 1024
PAGE = 4096
KERNEL = kernel_paths_available()
FUSE = fuse_available()
pytestmark = pytest.mark.skipif(shutil.which("mksquashfs") is None, reason="mksquashfs (squashfs-tools) missing")
FAST = FuseProcessConfig(start_timeout_s=30.0, stop_timeout_s=2.0, busy_grace_s=0.3)
range_examples = settings(max_examples=40)


# -- building images ------------------------------------------------------------------------

def build_tree(root: Path, rng: random.Random) -> None:
    """The fixture tree: every file's content is a function of ``rng``."""
    dirs = ["a", "a/b", "a/b/c", "a/b/c/deep", "d e", "ünï", "empty-dir"]
    for directory in dirs:
        (root / directory).mkdir(parents=True)
    sizes = [0, 0, 1, 100, 4095, PAGE, 20000, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 17, 3 * 2**20 + 5]
    for number, size in enumerate(sizes):
        (root / rng.choice(["", *dirs[:-1]]) / f"f{number}.bin").write_bytes(rng.randbytes(size))
    line = rng.randbytes(60).hex().encode() + b"\n"
    (root / "a/b/text.txt").write_bytes(line * (2 * 2**20 // len(line)))  # compresses well
    (root / "a/sparse.bin").write_bytes(bytes(3 * BLOCK) + rng.randbytes(1000) + bytes(BLOCK))
    for link, target in [("link-rel", "a/b/text.txt"), ("a/b/c/up", "../../sparse.bin"), ("dir-link", "a/b"),
                         ("abs-link", "/a/b/c"), ("dangling", "nowhere/at/all"), ("d e/chain", "../link-rel")]:
        os.symlink(target, root / link)


def mksquashfs(source: Path, image: Path) -> Path:
    subprocess.run(["mksquashfs", str(source), str(image), "-comp", "zstd", "-noappend", "-quiet", "-no-progress",
                    "-all-root"], check=True, capture_output=True)
    return image


def source_entries(root: Path) -> dict[str, tuple[str, bytes | str | None]]:
    """``{path: (kind, bytes for a file / target for a link / None)}`` from the source tree."""
    entries = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory, name)
            relative = str(path.relative_to(root))
            if path.is_symlink():
                entries[relative] = ("symlink", os.readlink(path))
            elif path.is_dir():
                entries[relative] = ("dir", None)
            else:
                entries[relative] = ("file", path.read_bytes())
    return entries


def data_region(image: Path) -> tuple[int, int]:
    """(offset, length) of the image's whole-page data area: past the superblock page and
    short of the page where the tables start, so the kernel can still mount and list it."""
    superblock = image.read_bytes()[:96]
    inode_table_start = struct.unpack_from("<Q", superblock, 64)[0]
    end = inode_table_start // PAGE * PAGE
    return PAGE, end - PAGE


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("image-mounts")
    build_tree(root / "src", random.Random(20240611))
    return root, mksquashfs(root / "src", root / "image.sqfs"), source_entries(root / "src")


# -- the front ends, behind one shape ---------------------------------------------------------

@dataclass
class FrontEnd:
    name: str
    read_range: Callable[[str, int, int], bytes]  # raises OSError, never a short answer before EOF
    entries: Callable[[], dict[str, str]]  # path → "dir" | "file" | "symlink"
    readlink: Callable[[str], str]
    listdir: Callable[[str], list[str]]


def reader_front_end(reader: SquashReader) -> FrontEnd:
    def read_range(path, offset, length):
        with reader.open(path) as file:
            file.seek(offset)
            return file.read(length)

    def entries():
        found = {}
        for directory, dirs, others in reader.walk():
            for name in dirs + others:
                path = f"{directory.rstrip('/')}/{name}".lstrip("/")
                entry = reader.stat(path)
                found[path] = "dir" if entry.is_dir else "symlink" if entry.is_symlink else "file"
        return found

    return FrontEnd("reader", read_range, entries, reader.readlink, reader.listdir)


def mounted_front_end(name: str, root: Path) -> FrontEnd:
    def read_range(path, offset, length):
        fd = os.open(root / path, os.O_RDONLY)
        try:
            chunks = []
            while length > 0:
                chunk = os.pread(fd, length, offset)
                if not chunk:
                    break
                chunks.append(chunk)
                offset, length = offset + len(chunk), length - len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def entries():
        found = {}
        for directory, dirs, files in os.walk(root):
            for entry in dirs + files:
                path = Path(directory, entry)
                kind = "symlink" if path.is_symlink() else "dir" if path.is_dir() else "file"
                found[str(path.relative_to(root))] = kind
        return found

    return FrontEnd(name, read_range, entries, lambda path: os.readlink(root / path),
                    lambda path: sorted(os.listdir(root / path)))


@pytest.fixture(scope="module", params=["reader", "fuse-dir", "kernel"])
def front_end(request, tree):
    root, image, _ = tree
    yield from _front_end(request.param, root, {"kind": "file", "path": str(image)}, "healthy")


@pytest.fixture(scope="module", params=["reader", "fuse-dir", "kernel"])
def damaged_front_end(request, tree):
    """The same image, its whole data area unreadable (EIO), its tables fine."""
    root, image, _ = tree
    spec = {"kind": "file", "path": str(image), "unreadable_ranges": [data_region(image)]}
    yield from _front_end(request.param, root, spec, "damaged")


def _front_end(name: str, root: Path, spec: dict, label: str):
    if name == "reader":
        source = UnreadableRanges(FileSource(Path(spec["path"])), spec.get("unreadable_ranges", []))
        yield reader_front_end(SquashReader(source))
        source.close()
        return
    available = KERNEL if name == "kernel" else FUSE
    if not available[0]:
        pytest.skip(f"{name} front end unavailable here: {available[1]}")
    target = root / f"{label} {name}"  # a space: the mount table escapes it
    target.mkdir()
    with mount_image(spec, target, mode=name, config=_config(root)) as mounted:
        yield mounted_front_end(name, mounted)


# -- what every front end must do ---------------------------------------------------------------

def test_the_listing_is_the_source_tree(front_end, tree):
    _, _, expected = tree
    assert front_end.entries() == {path: kind for path, (kind, _) in expected.items()}
    assert front_end.listdir("empty-dir") == []
    assert front_end.listdir("dir-link") == sorted(os.listdir(tree[0] / "src/a/b"))


def test_symlinks_keep_their_targets(front_end, tree):
    links = {path: target for path, (kind, target) in tree[2].items() if kind == "symlink"}
    assert {path: front_end.readlink(path) for path in links} == links


def test_every_file_reads_whole_and_through_relative_links(front_end, tree):
    files = {path: data for path, (kind, data) in tree[2].items() if kind == "file"}
    for path, data in files.items():
        assert front_end.read_range(path, 0, len(data) + 10) == data, path
    assert front_end.read_range("link-rel", 0, 1 << 30) == files["a/b/text.txt"]
    assert front_end.read_range("d e/chain", 5, 100) == files["a/b/text.txt"][5:105]
    assert front_end.read_range("a/b/c/up", BLOCK - 3, 10) == files["a/sparse.bin"][BLOCK - 3:BLOCK + 7]


@range_examples
@given(data=st.data())
def test_any_range_of_any_file_is_the_source_bytes(front_end, tree, data):
    files = sorted((path, content) for path, (kind, content) in tree[2].items() if kind == "file")
    path, content = data.draw(st.sampled_from(files), label="file")
    block_edges = [max(0, n * BLOCK + d) for n in range(len(content) // BLOCK + 2) for d in (-1, 0, 1)]
    offset = data.draw(st.integers(0, len(content) + 2) | st.sampled_from(block_edges), label="offset")
    length = data.draw(st.integers(0, 3 * BLOCK) | st.sampled_from([1, BLOCK - 1, BLOCK, BLOCK + 1]), label="length")
    assert front_end.read_range(path, offset, length) == content[offset:offset + length]


def test_unreadable_bytes_are_eio_never_wrong_bytes(damaged_front_end, tree):
    _, _, expected = tree
    assert damaged_front_end.entries() == {path: kind for path, (kind, _) in expected.items()}  # tables intact
    files = {path: data for path, (kind, data) in expected.items() if kind == "file"}
    # Random bytes do not compress: 20000 of them take more than the two pages at the edges
    # of the damaged area, so such a file cannot read. Others may, and then must read right.
    must_fail = {path for path, data in files.items() if len(data) >= 20000 and Path(path).name.startswith("f")}
    assert len(must_fail) >= 5
    outcomes = {}
    for path, data in files.items():
        try:
            outcomes[path] = damaged_front_end.read_range(path, 0, len(data)) == data or "WRONG BYTES"
        except OSError as exc:
            outcomes[path] = errno.errorcode.get(exc.errno, exc.errno)
    assert {path: outcome for path, outcome in outcomes.items() if outcome not in (True, "EIO")} == {}
    assert {path for path, outcome in outcomes.items() if outcome == "EIO"} >= must_fail


# -- the pure-Python reader ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def reader(tree):
    with FileSource(tree[1]) as source:
        yield SquashReader(source)


@pytest.mark.parametrize("call, error, code", [
    (lambda r: r.stat("no/such"), FileNotFoundError, errno.ENOENT),
    (lambda r: r.open("a/b"), IsADirectoryError, errno.EISDIR),
    (lambda r: r.open("dangling"), FileNotFoundError, errno.ENOENT),
    (lambda r: r.listdir("a/sparse.bin"), NotADirectoryError, errno.ENOTDIR),
    (lambda r: r.stat("a/sparse.bin/x"), NotADirectoryError, errno.ENOTDIR),
    (lambda r: r.readlink("a/sparse.bin"), OSError, errno.EINVAL),
])
def test_reader_errors_carry_an_errno(reader, call, error, code):
    with pytest.raises(error) as raised:
        call(reader)
    assert raised.value.errno == code


def test_reader_paths_and_symlinks_resolve_inside_the_image(reader, tree):
    text = (tree[0] / "src/a/b/text.txt").read_bytes()
    assert reader.read_bytes("/a/b/text.txt") == reader.read_bytes("a/./b/../b/text.txt") == text
    assert reader.listdir("abs-link") == sorted(os.listdir(tree[0] / "src/a/b/c"))  # "/a/b/c" is the image's
    assert reader.stat("dir-link").is_symlink and reader.stat("dir-link", follow_symlinks=True).is_dir
    assert reader.stat("/").is_dir and reader.exists("dangling") and not reader.exists("nope")
    assert reader.stat("a/b/text.txt").size == len(text)
    modes = {path: os.lstat(tree[0] / "src" / path).st_mode for path in tree[2]}
    assert {path: reader.stat(path).mode for path in tree[2]} == modes


def test_a_source_that_is_not_squashfs_is_refused(tmp_path):
    (tmp_path / "junk").write_bytes(os.urandom(8192))
    with FileSource(tmp_path / "junk") as source, pytest.raises(NotSquashfsError):
        SquashReader(source)


@settings(max_examples=60)
@given(offset=st.integers(0, 7 * 2**20), length=st.integers(1, 3 * BLOCK))
def test_reader_never_returns_wrong_bytes_whatever_range_fails(tree, offset, length):
    """Every answer is either right or OSError(EIO): no parser error, no other errno."""
    _, image, expected = tree
    with FileSource(image) as inner:
        try:
            reader = SquashReader(UnreadableRanges(inner, [(offset, length)]))
            for path, (kind, content) in expected.items():
                if kind == "file":
                    assert reader.read_bytes(path) == content
                elif kind == "symlink":
                    assert reader.readlink(path) == content
                else:
                    assert reader.listdir(path) == sorted(os.listdir(tree[0] / "src" / path))
        except OSError as exc:
            assert exc.errno == errno.EIO, exc


def test_a_short_read_from_the_source_is_eio_not_short_bytes(tree):
    class Short:
        def __init__(self, inner):
            self.inner, self.size = inner, inner.size

        def read(self, offset, length):
            return self.inner.read(offset, length)[: max(1, length // 2)]

        def close(self):
            pass

    with FileSource(tree[1]) as inner, pytest.raises(OSError) as raised:
        SourceFile(Short(inner)).read(1000)
    assert raised.value.errno == errno.EIO


def test_source_file_keeps_one_position_per_thread(tree):
    with FileSource(tree[1]) as source:
        shared = SourceFile(source)
        seeked, other_seeked = threading.Event(), threading.Event()
        answers = {}

        def other():
            seeked.wait()
            shared.seek(5000)
            other_seeked.set()
            answers["other"] = shared.read(8)

        thread = threading.Thread(target=other)
        thread.start()
        shared.seek(100)
        seeked.set()
        other_seeked.wait()
        answers["main"] = shared.read(8)
        thread.join()
        assert answers == {"main": source.read(100, 8), "other": source.read(5000, 8)}


def test_concurrent_reads_through_one_reader_are_all_right(reader, tree):
    files = [(path, data) for path, (kind, data) in tree[2].items() if kind == "file" and len(data) > BLOCK]
    wrong = []

    def read_all(path, data):
        for offset in range(0, len(data), BLOCK // 3):
            with reader.open(path) as file:
                if file.pread(offset, BLOCK // 2) != data[offset:offset + BLOCK // 2]:
                    wrong.append((path, offset))

    threads = [threading.Thread(target=read_all, args=item) for item in files * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


names = st.text("abcxyz-_ é", min_size=1, max_size=6).filter(lambda name: name.strip(". ") == name)
random_trees = st.dictionaries(st.lists(names, min_size=1, max_size=3).map("/".join),
                               st.one_of(st.integers(0, 3 * BLOCK + 7), st.sampled_from([BLOCK - 1, BLOCK, BLOCK + 1])),
                               max_size=8)


@settings(max_examples=12)
@given(files=random_trees, seed=st.integers(0, 2**32))
def test_any_random_tree_round_trips_through_the_reader(tmp_path_factory, files, seed):
    root = tmp_path_factory.mktemp("random-tree")
    rng = random.Random(seed)
    written = {}
    for path, size in sorted(files.items()):
        target = root / "src" / path
        if any(parent in written for parent in Path(path).parents) or any(p.startswith(path + "/") for p in files):
            continue  # a name used as both a file and a directory
        target.parent.mkdir(parents=True, exist_ok=True)
        written[path] = rng.randbytes(size) if rng.random() < 0.5 else bytes([rng.randrange(4)]) * size
        target.write_bytes(written[path])
    (root / "src").mkdir(exist_ok=True)
    with FileSource(mksquashfs(root / "src", root / "image.sqfs")) as source:
        reader = SquashReader(source)
        assert {path: reader.read_bytes(path) for path in written} == written
        listed = {f"{d.rstrip('/')}/{n}".lstrip("/") for d, _, others in reader.walk() for n in others}
        assert listed == set(written)


# -- mounting and teardown -----------------------------------------------------------------------

def our_leftovers(root: Path) -> list[str]:
    """Mounts under ``root``, loop devices backed by a file under it, daemon children (serving a
    mountpoint under it) not reaped."""
    found = []
    for line in Path("/proc/mounts").read_text().splitlines():
        mount_point = line.split()[1].encode().decode("unicode_escape").encode("latin-1").decode()
        if mount_point.startswith(str(root)):
            found.append(f"mount {line}")
    listed = subprocess.run(["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"],
                            capture_output=True, text=True).stdout if shutil.which("losetup") else ""
    found += [f"loop {line}" for line in listed.splitlines() if str(root) in line]
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rpartition(")")[2].split()
            cmdline = (stat_file.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"images.mount.daemon" in cmdline and str(root).encode() in cmdline:
            found.append(f"child {stat_file.parent.name} state {fields[0]}")
    return found


def _require(mode: str) -> None:
    available = KERNEL if mode == "kernel" else FUSE
    if not available[0]:
        pytest.skip(f"{mode} unavailable here: {available[1]}")


def _config(root: Path) -> MountConfig:
    return MountConfig(kernel=LoopMountConfig(fuse=FAST, busy_grace_s=0.3, private_root=str(root)), fuse_dir=FAST)


def _mounted(mode: str, spec: dict, target: Path, root: Path):
    """The mount object itself, to see the exact loop device and daemon it used."""
    if mode == "kernel":
        return LoopMount.open(spec, target, config=_config(root).kernel)
    return FuseProcess.start("dir", spec, target, config=FAST)


@pytest.mark.parametrize("mode", ["fuse-dir", "kernel"])
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_teardown_leaves_no_mount_loop_device_or_daemon(mode, busy, tree, tmp_path):
    _require(mode)
    target = tmp_path / "target"
    target.mkdir()
    mount = _mounted(mode, {"kind": "file", "path": str(tree[1])}, target, tmp_path)
    daemon = mount.fuse if mode == "kernel" else mount
    device = getattr(mount, "loop_device", None)
    assert daemon.running() and our_leftovers(tmp_path)  # the checks below can see a mount
    assert device is None or loop_backing_file(device).startswith(str(tmp_path))
    holders = []
    if busy:  # an open file and a process whose working directory is in the tree
        holders = [open(target / "a/b/text.txt", "rb"),
                   subprocess.Popen(["sleep", "60"], cwd=target / "a", stdout=subprocess.DEVNULL)]
    try:
        mount.close() if mode == "kernel" else mount.stop()
        assert not daemon.running()
        assert [item for item in our_leftovers(tmp_path) if not item.startswith("loop")] == []
        assert mount.lazily_detached == busy
    finally:
        for holder in holders:
            holder.close() if hasattr(holder, "close") else (holder.kill(), holder.wait())
    # a busy loop device is detached by the kernel when its last user lets go
    deadline = time.monotonic() + 10
    while device and (loop_backing_file(device) or "").startswith(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (device and (loop_backing_file(device) or "").startswith(str(tmp_path)))
    assert our_leftovers(tmp_path) == []


@pytest.mark.parametrize("mode, spec, message", [
    ("kernel", "junk", "mounting"),  # daemon and loop device up, then the kernel refuses the fs
    ("kernel", "missing", "exited"),  # the daemon cannot open its source
    ("fuse-dir", "junk", "exited"),  # the daemon's reader refuses the source
])
def test_a_set_up_that_fails_halfway_leaves_nothing(mode, spec, message, tmp_path):
    _require(mode)
    (tmp_path / "junk").write_bytes(os.urandom(3 * BLOCK))
    (tmp_path / "target").mkdir()
    with pytest.raises(MountError, match=message):
        with mount_image({"kind": "file", "path": str(tmp_path / spec)}, tmp_path / "target", mode,
                         config=_config(tmp_path)):
            pytest.fail("mounted a source that cannot mount")
    assert our_leftovers(tmp_path) == []
    assert sorted(path.name for path in tmp_path.iterdir()) == ["junk", "target"]  # private dir removed


def test_the_daemon_writes_its_source_stats_on_request(tree, tmp_path):
    _require("fuse-dir")
    spec = {"kind": "file", "path": str(tree[1]), "unreadable_ranges": [data_region(tree[1])]}
    stats_file = tmp_path / "stats.json"
    (tmp_path / "target").mkdir()
    biggest = max((path for path, (kind, _) in tree[2].items() if kind == "file"), key=lambda p: len(tree[2][p][1]))
    with FuseProcess.start("dir", spec, tmp_path / "target", config=FAST, stats_file=stats_file) as daemon:
        with pytest.raises(OSError):
            (tmp_path / "target" / biggest).read_bytes()
        daemon.request_stats()
        deadline = time.monotonic() + 10
        while not stats_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert '"failed_reads": ' in stats_file.read_text() and '"failed_reads": 0' not in stats_file.read_text()
    assert our_leftovers(tmp_path) == []


# -- end to end: a seekable image in a real registry, fetched lazily by the daemon ---------------

@pytest.mark.parametrize("mode", ["kernel", "fuse-dir"])
def test_a_lazy_registry_image_mounts_and_reads_like_the_source(mode, tree, tmp_path, monkeypatch):
    """The daemon opens ``{"kind": "registry"}`` itself: HttpRegistry with the credentials from
    the environment, the lazy fetcher, the start-up prefetch, then reads fetched on demand."""
    from images.oci.client import HttpRegistry
    from images.oci.server import EmbeddedRegistry, find_registry_binary
    from images.seekable.build import build_seekable

    _require(mode)
    if find_registry_binary() is None:
        pytest.skip("no registry binary (docker-registry) to serve the image")
    built = build_seekable(tree[0] / "src", tmp_path / "build", sector_bytes=256 * 1024)
    with EmbeddedRegistry(tmp_path / "registry", htpasswd=("puller", "s3cret")).start() as registry:
        client = HttpRegistry(registry.url, username="puller", password="s3cret")
        client.push_blob("models/tree", built.data_path)
        index_digest, _ = client.push_blob("models/tree", built.index.to_json())
        monkeypatch.setenv("MODELPLANE_REGISTRY_USERNAME", "puller")
        monkeypatch.setenv("MODELPLANE_REGISTRY_PASSWORD", "s3cret")
        spec = {"kind": "registry", "url": registry.url, "repo": "models/tree", "index_digest": index_digest,
                "cache_root": str(tmp_path / "cache"), "max_cache_bytes": 64 * 2**20, "prefetch": mode == "kernel"}
        (tmp_path / "target").mkdir()
        stats_file = tmp_path / "stats.json"
        with mount_image(spec, tmp_path / "target", mode, config=_config(tmp_path), stats_file=stats_file) as root:
            front_end = mounted_front_end(mode, root)
            assert front_end.entries() == {path: kind for path, (kind, _) in tree[2].items()}
            for path, (kind, content) in tree[2].items():
                if kind == "file":
                    assert front_end.read_range(path, 0, len(content) + 1) == content, path
    assert our_leftovers(tmp_path) == []
    assert json.loads(stats_file.read_text())["bytes_fetched"] > 0
