"""The OCI image layout on disk, pushing it to a registry, and the full pull.

:func:`write_layout` turns built layers (:func:`images.oci.layers.build_layer`) and an
:class:`ImageConfig` into an OCI image layout directory (``oci-layout``, ``index.json``,
``blobs/sha256/<hex>``), which ``skopeo``, ``umoci`` and ``podman`` read as it is. Config
and manifest are canonical JSON with a fixed ``created`` time, so the same layers give the
same manifest digest on every build.

:func:`pull_image` is the anchor the lazy path is measured against: what a container runtime
does before it can start anything, namely download every layer in full, then unpack them in
order into one directory.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from images.oci.layers import LayerInfo
from images.oci.registry import (
    CONFIG, DOCKER_LAYER_GZIP, DOCKER_MANIFEST, DOCKER_MANIFEST_LIST, INDEX, LAYER_GZIP, MANIFEST,
    Descriptor, Registry, check_digest, sha256_digest,
)

REF_NAME = "org.opencontainers.image.ref.name"
EPOCH = "1970-01-01T00:00:00Z"  # ``created`` of every config: a rebuild must not change digests
LAYOUT_VERSION = {"imageLayoutVersion": "1.0.0"}
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
EXTRACTABLE_LAYERS = {LAYER_GZIP, DOCKER_LAYER_GZIP, LAYER_TAR}
WHITEOUT = ".wh."
OPAQUE_WHITEOUT = ".wh..wh..opq"


def host_architecture(machine: str | None = None) -> str:
    """The OCI ``architecture`` of this machine (or of ``machine``, as ``uname -m`` prints it).

    >>> host_architecture("x86_64"), host_architecture("aarch64"), host_architecture("ppc64le")
    ('amd64', 'arm64', 'ppc64le')
    """
    machine = (machine or platform.machine()).lower()
    return {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)


def canonical_json(value: object) -> bytes:
    """Sorted keys, no whitespace: the same value is always the same bytes (and digest).

    >>> canonical_json({"b": 1, "a": [2]})
    b'{"a":[2],"b":1}'
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class ImageConfig:
    """What runs when the image starts, in the OCI image config's terms."""

    env: dict[str, str] = field(default_factory=dict)
    cmd: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    working_dir: str = ""
    entrypoint: list[str] = field(default_factory=list)
    architecture: str = field(default_factory=host_architecture)
    os: str = "linux"

    def to_json(self, diff_ids: list[str]) -> dict:
        """The image config document for layers with these ``diff_ids`` (bottom first)."""
        run: dict = {}
        if self.env:
            run["Env"] = [f"{key}={value}" for key, value in self.env.items()]
        if self.entrypoint:
            run["Entrypoint"] = list(self.entrypoint)
        if self.cmd:
            run["Cmd"] = list(self.cmd)
        if self.labels:
            run["Labels"] = dict(self.labels)
        if self.working_dir:
            run["WorkingDir"] = self.working_dir
        return {
            "created": EPOCH,
            "architecture": self.architecture,
            "os": self.os,
            "config": run,
            "rootfs": {"type": "layers", "diff_ids": list(diff_ids)},
            "history": [{"created": EPOCH, "created_by": f"modelplane build_layer {i}"} for i in range(len(diff_ids))],
        }


def blob_path(directory: Path, digest: str) -> Path:
    return Path(directory) / "blobs" / "sha256" / check_digest(digest).removeprefix("sha256:")


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def _write_blob(directory: Path, data: bytes, media_type: str) -> Descriptor:
    digest = sha256_digest(data)
    target = blob_path(directory, digest)
    if not target.exists():
        _write_atomically(target, data)
    return Descriptor(media_type, digest, len(data))


def _place_layer(source: Path, target: Path) -> None:
    """Hard-link the layer into the layout (no copy of GBs); copy only across filesystems."""
    if target.exists():
        return
    try:
        os.link(source, target)
    except FileExistsError:
        pass
    except OSError:
        temporary = target.with_name(f".{target.name}.tmp")
        shutil.copyfile(source, temporary)
        os.replace(temporary, target)


def write_layout(directory: Path, layers: list[tuple[LayerInfo, Path]], config: ImageConfig,
                 ref_name: str) -> Descriptor:
    """Write (or add to) an OCI image layout; returns the manifest's descriptor.

    The manifest is listed in ``index.json`` under ``ref_name`` (replacing an earlier one of
    that name), so ``skopeo copy oci:<directory>:<ref_name> ...`` finds it.
    """
    directory = Path(directory)
    (directory / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    _write_atomically(directory / "oci-layout", canonical_json(LAYOUT_VERSION))
    for info, path in layers:
        if os.stat(path).st_size != info.size:
            raise ValueError(f"{path} has {os.stat(path).st_size} bytes, its LayerInfo says {info.size}")
        _place_layer(Path(path), blob_path(directory, info.digest))
    config_descriptor = _write_blob(directory, canonical_json(config.to_json([info.diff_id for info, _ in layers])),
                                    CONFIG)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": config_descriptor.to_json(),
        "layers": [Descriptor(info.media_type, info.digest, info.size).to_json() for info, _ in layers],
    }
    written = _write_blob(directory, canonical_json(manifest), MANIFEST)
    descriptor = Descriptor(MANIFEST, written.digest, written.size, {REF_NAME: ref_name})
    index_path = directory / "index.json"
    index = json.loads(index_path.read_bytes()) if index_path.exists() else {"schemaVersion": 2, "manifests": []}
    others = [entry for entry in index.get("manifests", [])
              if (entry.get("annotations") or {}).get(REF_NAME) != ref_name]
    entry = descriptor.to_json() | {"platform": {"architecture": config.architecture, "os": config.os}}
    index = {"schemaVersion": 2, "mediaType": INDEX, "manifests": [*others, entry]}
    _write_atomically(index_path, canonical_json(index))
    return descriptor


def _read_verified(directory: Path, descriptor: Descriptor) -> bytes:
    data = blob_path(directory, descriptor.digest).read_bytes()
    if sha256_digest(data) != descriptor.digest:
        raise ValueError(f"blob {descriptor.digest} in {directory} does not match its digest")
    return data


def read_layout(directory: Path, ref_name: str) -> tuple[dict, Descriptor, dict]:
    """(manifest, manifest descriptor, config) of the image named ``ref_name`` in the layout."""
    directory = Path(directory)
    if not (directory / "oci-layout").exists():
        raise FileNotFoundError(f"{directory} is not an OCI image layout (no oci-layout file)")
    index = json.loads((directory / "index.json").read_bytes())
    entries = index.get("manifests", [])
    matches = [entry for entry in entries if (entry.get("annotations") or {}).get(REF_NAME) == ref_name]
    if not matches:
        names = sorted((entry.get("annotations") or {}).get(REF_NAME, "?") for entry in entries)
        raise LookupError(f"{directory} has no image named {ref_name!r} (it has {names})")
    descriptor = Descriptor.from_json(matches[-1])
    manifest = json.loads(_read_verified(directory, descriptor))
    config = json.loads(_read_verified(directory, Descriptor.from_json(manifest["config"])))
    return manifest, descriptor, config


def push_layout(registry: Registry, directory: Path, repo: str, tag: str, *, ref_name: str | None = None) -> Descriptor:
    """Push the image ``ref_name`` (default: ``tag``) of a layout as ``repo:tag``.

    Blobs go first, each only if the registry lacks it, then the manifest: a registry checks
    that a manifest's blobs exist, and a pull never sees a tag whose layers are missing.
    """
    manifest, descriptor, _ = read_layout(directory, ref_name or tag)
    for blob in [manifest["config"], *manifest["layers"]]:
        wanted = Descriptor.from_json(blob)
        if registry.has_blob(repo, wanted.digest):
            continue
        digest, _size = registry.push_blob(repo, blob_path(directory, wanted.digest))
        if digest != wanted.digest:
            raise ValueError(f"blob {wanted.digest} in {directory} has digest {digest}; the layout is corrupt")
    body = blob_path(directory, descriptor.digest).read_bytes()
    digest = registry.put_manifest(repo, tag, body, descriptor.media_type)
    return Descriptor(descriptor.media_type, digest, len(body))


@dataclass(frozen=True)
class PullStats:
    """What a full pull cost: every byte downloaded before the first file could be read."""

    bytes_downloaded: int
    download_s: float
    extract_s: float
    layers: int


def resolve_manifest(registry: Registry, repo: str, reference: str, architecture: str | None = None) -> dict:
    """The image manifest of ``reference``; an index resolves to its linux/<architecture> entry."""
    body, media_type, _ = registry.get_manifest(repo, reference)
    document = json.loads(body)
    media_type = media_type or document.get("mediaType", "")
    if media_type in (INDEX, DOCKER_MANIFEST_LIST):
        architecture = architecture or host_architecture()
        for entry in document.get("manifests", []):
            wanted = entry.get("platform") or {}
            if wanted.get("os") == "linux" and wanted.get("architecture") == architecture:
                return resolve_manifest(registry, repo, entry["digest"], architecture)
        raise LookupError(f"{repo}:{reference} has no manifest for linux/{architecture}")
    if media_type not in (MANIFEST, DOCKER_MANIFEST):
        raise ValueError(f"{repo}:{reference} is a {media_type}, not an image manifest")
    return document


def _remove(path: Path, dest: Path) -> None:
    """Delete ``path`` (a tree, a file or a link) if it lies in ``dest``, following no links out."""
    parent, root = os.path.realpath(path.parent), os.path.realpath(dest)
    if not os.path.lexists(path) or not (parent == root or parent.startswith(root + os.sep)):
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _applied_members(tar: tarfile.TarFile, dest: Path, digest: str):
    """The members of one layer to extract, after applying its whiteouts to ``dest``.

    A ``.wh.<name>`` entry deletes ``name`` from the layers below; ``.wh..wh..opq`` empties
    its directory. An entry replaces what lower layers left at its path (a file over a
    symlink must not write through the link).
    """
    for member in tar:
        if member.name.startswith("/") or ".." in PurePosixPath(member.name).parts:
            raise ValueError(f"layer {digest}: entry {member.name!r} is absolute or leaves the image with '..'")
        parts = PurePosixPath(member.name).parts
        if not parts:
            continue
        parent = dest.joinpath(*parts[:-1])
        if parts[-1] == OPAQUE_WHITEOUT:
            if parent.is_dir() and not parent.is_symlink():
                for child in parent.iterdir():
                    _remove(child, dest)
            continue
        if parts[-1].startswith(WHITEOUT):
            _remove(parent / parts[-1][len(WHITEOUT):], dest)
            continue
        for depth in range(1, len(parts)):
            if dest.joinpath(*parts[:depth]).is_symlink():  # extracting through it could write outside dest
                raise ValueError(f"layer {digest}: entry {member.name!r} lies under the symlink "
                                 f"{'/'.join(parts[:depth])!r}")
        target = dest.joinpath(*parts)
        if os.path.lexists(target) and not (member.isdir() and target.is_dir() and not target.is_symlink()):
            _remove(target, dest)
        yield member


def _rootfs_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """tarfile's "data" filter, except that a symlink to an absolute path is kept: in an image
    it names a path in the image's root (``bin/python3 -> /usr/bin/python3.11``), and nothing
    here follows it (no entry is extracted through a symlink, see ``_applied_members``)."""
    if member.issym() and member.linkname.startswith("/"):
        tarfile.data_filter(member.replace(linkname=".", deep=False), dest)  # every other check
        return member.replace(mode=(member.mode or 0o777) & 0o777, uid=None, gid=None, uname=None, gname=None,
                              deep=False)
    return tarfile.data_filter(member, dest)


def extract_layer(path: Path, dest: Path, digest: str = "") -> None:
    """Unpack one layer blob (gzip or plain tar) over ``dest`` with tarfile's "data" filter,
    which refuses links out of ``dest``, device files and setuid bits — but keeps symlinks to
    absolute paths, which in an image mean paths in its root (:func:`_rootfs_filter`)."""
    try:
        with tarfile.open(path, mode="r|*") as tar:
            tar.extractall(dest, members=_applied_members(tar, dest, digest), filter=_rootfs_filter)
    except tarfile.FilterError as exc:
        raise ValueError(f"layer {digest}: {exc}") from exc


def pull_image(registry: Registry, repo: str, reference: str, dest: Path, *, parallel_downloads: int = 3) -> PullStats:
    """Download every layer of ``repo:reference`` (digests checked), then unpack them into ``dest``.

    Layers are downloaded next to ``dest`` (same filesystem, removed afterwards), up to
    ``parallel_downloads`` at a time like a container runtime, and unpacked bottom first.
    """
    dest = Path(dest)
    manifest = resolve_manifest(registry, repo, reference)
    layers = [Descriptor.from_json(entry) for entry in manifest.get("layers", [])]
    for layer in layers:
        if layer.media_type not in EXTRACTABLE_LAYERS:
            raise ValueError(f"layer {layer.digest} of {repo}:{reference} is {layer.media_type}, not a tar layer")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.layers-") as scratch:
        paths = [Path(scratch) / f"{i}-{layer.digest.removeprefix('sha256:')}" for i, layer in enumerate(layers)]
        started = time.perf_counter()
        with ThreadPoolExecutor(max(1, parallel_downloads)) as pool:
            sizes = list(pool.map(lambda layer, path: registry.download_blob(repo, layer.digest, path), layers, paths))
        downloaded = time.perf_counter()
        for layer, path, size in zip(layers, paths, sizes):
            if size != layer.size:
                raise ValueError(f"layer {layer.digest} has {size} bytes, the manifest says {layer.size}")
            extract_layer(path, dest, layer.digest)
            path.unlink()
        extracted = time.perf_counter()
    return PullStats(sum(sizes), downloaded - started, extracted - downloaded, len(layers))
