"""Layers, the image layout, push and the full pull: deterministic bytes, checked by real tools.

umoci and skopeo read the layouts written here, the embedded docker-registry stores what
push_layout sends, and pull_image must give back the tree that went in.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from images.oci.client import HttpRegistry
from images.oci.fake import FakeRegistry
from images.oci.layers import build_layer
from images.oci.layout import (
    EPOCH, REF_NAME, ImageConfig, blob_path, canonical_json, extract_layer, pull_image, push_layout, read_layout,
    write_layout,
)
from images.oci.registry import CONFIG, LAYER_GZIP, MANIFEST, sha256_digest
from tests.oci_fixtures import embedded_registry, make_tree, snapshot  # noqa: F401 - a fixture

MODEL_PREFIX = "opt/modelplane/model"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "tree")


def layer_names(blob: Path) -> list[str]:
    with tarfile.open(blob) as tar:
        return tar.getnames()


# -- layers ------------------------------------------------------------------------------

def test_the_same_tree_gives_byte_identical_layers_whatever_the_times_and_the_place(tree, tmp_path):
    first = build_layer(tree, tmp_path / "first.tar.gz")
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(tree, copy, symlinks=True)  # new inodes, new ctimes, a different parent
    for path in [copy, *copy.rglob("*")]:
        os.utime(path, (123456789, 987654321), follow_symlinks=False)
    second = build_layer(copy, tmp_path / "second.tar.gz")
    assert first == second
    assert (tmp_path / "first.tar.gz").read_bytes() == (tmp_path / "second.tar.gz").read_bytes()


def test_a_known_tree_gives_the_tar_it_gave_in_every_earlier_release(tmp_path):
    """The tar's digest (diff_id) is pinned: a registry that holds a layer from an older
    build is not sent it again. (The gzip blob's digest also depends on ISA-L's build and kernels: docs/images.md.)"""
    root = tmp_path / "tree"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "serve").write_text("#!/bin/sh\nexec python -m serve\n")
    (root / "weights.bin").write_bytes(bytes(range(256)) * 5000)
    (root / "tokenizer-é.json").write_text("{}")
    (root / "latest").symlink_to("weights.bin")
    for path, mode in [(root, 0o755), (root / "bin", 0o755), (root / "bin" / "serve", 0o755),
                       (root / "weights.bin", 0o644), (root / "tokenizer-é.json", 0o644)]:
        path.chmod(mode)
    info = build_layer(root, tmp_path / "layer.tar.gz", prefix="opt/model")
    assert (info.diff_id, info.uncompressed_size) == (
        "sha256:153101413f55028dd02d18b825272bad93bc983370f4f842ba08b054264bd252", 1290240)


@pytest.mark.parametrize("change", ["one byte", "a mode", "a symlink target", "a new empty file"])
def test_any_change_to_the_tree_changes_the_digest(tree, tmp_path, change):
    before = build_layer(tree, tmp_path / "before.tar.gz")
    if change == "one byte":
        (tree / "config.json").write_text('{"hidden_size": 65}\n')
    elif change == "a mode":
        (tree / "private.key").chmod(0o644)
    elif change == "a symlink target":
        (tree / "latest").unlink()
        (tree / "latest").symlink_to("weights/shards/model-00002.safetensors")
    else:
        (tree / "weights" / "new").write_bytes(b"")
    after = build_layer(tree, tmp_path / "after.tar.gz")
    assert after.digest != before.digest and after.diff_id != before.diff_id


def test_digest_is_of_the_gzip_blob_and_diff_id_of_the_tar(tree, tmp_path):
    blob = tmp_path / "layer.tar.gz"
    info = build_layer(tree, blob)
    compressed = blob.read_bytes()
    uncompressed = gzip.decompress(compressed)
    assert info.digest == sha256_digest(compressed) and info.size == len(compressed)
    assert info.diff_id == sha256_digest(uncompressed) and info.uncompressed_size == len(uncompressed)
    assert info.media_type == LAYER_GZIP


def test_gzip_header_holds_no_time_and_no_file_name(tree, tmp_path):
    header = (tmp_path / "named-after-nothing.tar.gz")
    build_layer(tree, header)
    data = header.read_bytes()
    assert data[:3] == b"\x1f\x8b\x08"
    assert data[3] == 0, "FLG must be 0: no FNAME (file name) and no FCOMMENT"
    assert data[4:8] == b"\0\0\0\0", "MTIME must be 0"


def test_entries_are_sorted_owned_by_root_at_time_zero_with_their_modes(tree, tmp_path):
    blob = tmp_path / "layer.tar.gz"
    build_layer(tree, blob)
    with tarfile.open(blob) as tar:
        members = {member.name: member for member in tar.getmembers()}
        names = list(members)
        hard_link_copy = tar.extractfile(members["config-copy.json"]).read()
    assert names == ["config-copy.json", "config.json", "empty-dir", "latest", "private.key", "run.sh",
                     "tokenizer-é.json", "weights", "weights/empty", "weights/shards",
                     "weights/shards/model-00001.safetensors", "weights/shards/model-00002.safetensors"]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members.values()} == {(0, 0, 0, "", "")}
    assert members["run.sh"].mode == 0o755 and members["private.key"].mode == 0o600
    assert members["latest"].issym() and members["latest"].linkname == "weights/shards/model-00001.safetensors"
    assert members["config-copy.json"].isreg(), "a hard link is written as a regular file"
    assert hard_link_copy == (tree / "config.json").read_bytes()
    assert members["weights"].isdir() and members["empty-dir"].isdir()


def test_prefix_puts_the_tree_under_it_with_its_parents_as_entries(tree, tmp_path):
    blob = tmp_path / "layer.tar.gz"
    build_layer(tree, blob, prefix=MODEL_PREFIX)
    names = layer_names(blob)
    assert names[:3] == ["opt", "opt/modelplane", "opt/modelplane/model"]
    assert f"{MODEL_PREFIX}/weights/shards/model-00001.safetensors" in names
    assert all(name.startswith("opt") for name in names)


def test_exclude_leaves_out_paths_and_the_subtrees_of_directories(tree, tmp_path):
    blob = tmp_path / "layer.tar.gz"
    build_layer(tree, blob, exclude=lambda relative: relative in ("weights/shards", "private.key"))
    names = layer_names(blob)
    assert "private.key" not in names
    assert "weights" in names and "weights/empty" in names
    assert not any(name.startswith("weights/shards") for name in names)


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_special_files_are_refused_naming_the_path(tree, tmp_path, kind):
    special = tree / "weights" / f"a-{kind}"
    if kind == "fifo":
        os.mkfifo(special)
    else:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(special))
        listener.close()
    out = tmp_path / "layer.tar.gz"
    with pytest.raises(ValueError, match=f"a-{kind}"):
        build_layer(tree, out)
    assert list(tmp_path.iterdir()) == [tree], "a failed build leaves no half-written layer"


def test_a_large_file_is_streamed_not_held_in_memory(tmp_path):
    root = tmp_path / "big"
    root.mkdir()
    with open(root / "weights.bin", "wb") as sparse:
        sparse.truncate(256 << 20)
    tracemalloc.start()
    try:
        info = build_layer(root, tmp_path / "big.tar.gz")
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.uncompressed_size > 256 << 20
    assert peak_bytes < 16 << 20, f"building a 256 MiB layer allocated {peak_bytes >> 20} MiB at peak"


names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._-é", min_size=1, max_size=12).filter(
    lambda name: name not in (".", ".."))
trees = st.recursive(st.binary(max_size=2000), lambda children: st.dictionaries(names, children, max_size=4),
                     max_leaves=12).filter(lambda value: isinstance(value, dict))


def write_tree(root: Path, spec: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, value in spec.items():
        if isinstance(value, dict):
            write_tree(root / name, value)
        else:
            (root / name).write_bytes(value)


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=trees)
def test_any_tree_extracts_back_to_the_same_files(tmp_path_factory, spec):
    work = tmp_path_factory.mktemp("property")
    write_tree(work / "source", spec)
    info = build_layer(work / "source", work / "layer.tar.gz")
    extract_layer(work / "layer.tar.gz", work / "out", info.digest)
    assert snapshot(work / "out") == snapshot(work / "source")


# -- the image layout --------------------------------------------------------------------

def build_image(tree: Path, work: Path, ref_name: str = "v1", config: ImageConfig | None = None):
    """Two layers (the model under its prefix, a small app layer) written as a layout."""
    app = work / "app"
    (app / "srv").mkdir(parents=True, exist_ok=True)
    (app / "srv" / "serve.py").write_text("print('serving')\n")
    model_layer = build_layer(tree, work / "model.tar.gz", prefix=MODEL_PREFIX)
    app_layer = build_layer(app, work / "app.tar.gz")
    config = config or ImageConfig(env={"MODEL_DIR": f"/{MODEL_PREFIX}"}, cmd=["python", "/srv/serve.py"],
                                   labels={"modelplane.model": "demo"}, working_dir="/srv")
    layers = [(model_layer, work / "model.tar.gz"), (app_layer, work / "app.tar.gz")]
    return write_layout(work / "layout", layers, config, ref_name), layers


def expected_image_tree(tree: Path) -> dict[str, tuple]:
    expected = {f"{MODEL_PREFIX}/{path}": entry for path, entry in snapshot(tree).items()}
    for directory in ["opt", "opt/modelplane", MODEL_PREFIX, "srv"]:
        expected[directory] = ("dir", 0o755, None)
    expected["srv/serve.py"] = ("file", 0o644, hashlib.sha256(b"print('serving')\n").hexdigest())
    return expected


def test_read_layout_gives_back_the_manifest_and_config_that_were_written(tree, tmp_path):
    descriptor, layers = build_image(tree, tmp_path)
    manifest, found, config = read_layout(tmp_path / "layout", "v1")
    assert found == descriptor and descriptor.annotations == {REF_NAME: "v1"}
    assert manifest["schemaVersion"] == 2 and manifest["mediaType"] == MANIFEST
    assert manifest["config"]["mediaType"] == CONFIG
    assert [layer["digest"] for layer in manifest["layers"]] == [info.digest for info, _ in layers]
    assert config["rootfs"] == {"type": "layers", "diff_ids": [info.diff_id for info, _ in layers]}
    assert config["created"] == EPOCH and {entry["created"] for entry in config["history"]} == {EPOCH}
    assert config["config"]["Env"] == [f"MODEL_DIR=/{MODEL_PREFIX}"]
    assert config["config"]["Cmd"] == ["python", "/srv/serve.py"] and config["config"]["WorkingDir"] == "/srv"
    assert config["os"] == "linux" and config["architecture"] in ("amd64", "arm64")


def test_the_same_layers_and_config_give_the_same_manifest_digest(tree, tmp_path):
    first, _ = build_image(tree, tmp_path / "a")
    second, _ = build_image(tree, tmp_path / "b")
    assert first.digest == second.digest
    assert (tmp_path / "a/layout/index.json").read_bytes() == (tmp_path / "b/layout/index.json").read_bytes()


def test_layer_blobs_are_hard_linked_into_the_layout_not_copied(tree, tmp_path):
    _, layers = build_image(tree, tmp_path)
    for info, path in layers:
        assert os.stat(blob_path(tmp_path / "layout", info.digest)).st_ino == os.stat(path).st_ino


def test_rebuilding_a_layer_file_leaves_the_layout_that_linked_it_intact(tree, tmp_path):
    descriptor, layers = build_image(tree, tmp_path)
    (tree / "config.json").write_text("changed")
    build_layer(tree, tmp_path / "model.tar.gz", prefix=MODEL_PREFIX)  # the same path as the linked layer
    manifest, _, _ = read_layout(tmp_path / "layout", "v1")
    for layer in manifest["layers"]:
        assert sha256_digest(blob_path(tmp_path / "layout", layer["digest"]).read_bytes()) == layer["digest"]


def test_a_layout_holds_several_names_and_rewriting_a_name_replaces_it(tree, tmp_path):
    build_image(tree, tmp_path, "v1")
    other, _ = build_image(tree, tmp_path, "v2", ImageConfig(cmd=["true"]))
    replaced, _ = build_image(tree, tmp_path, "v1", ImageConfig(cmd=["false"]))
    index = json.loads((tmp_path / "layout" / "index.json").read_bytes())
    assert sorted(entry["annotations"][REF_NAME] for entry in index["manifests"]) == ["v1", "v2"]
    assert read_layout(tmp_path / "layout", "v1")[1].digest == replaced.digest
    assert read_layout(tmp_path / "layout", "v2")[1].digest == other.digest
    with pytest.raises(LookupError, match="v3"):
        read_layout(tmp_path / "layout", "v3")


@pytest.mark.skipif(shutil.which("umoci") is None, reason="umoci is not installed (apt-get install umoci)")
def test_umoci_unpacks_the_layout_into_the_tree(tree, tmp_path):
    build_image(tree, tmp_path)
    bundle = tmp_path / "bundle"
    subprocess.run(["umoci", "unpack", "--rootless", "--image", f"{tmp_path / 'layout'}:v1", str(bundle)],
                   check=True, capture_output=True, timeout=60)
    assert snapshot(bundle / "rootfs") == expected_image_tree(tree)


# -- the registry: skopeo, push_layout and pull_image ------------------------------------

@pytest.mark.skipif(shutil.which("skopeo") is None, reason="skopeo is not installed (apt-get install skopeo)")
def test_skopeo_copies_the_layout_to_the_registry_with_our_digests(tree, tmp_path, embedded_registry):
    descriptor, layers = build_image(tree, tmp_path)
    policy = tmp_path / "policy.json"
    policy.write_text('{"default": [{"type": "insecureAcceptAnything"}]}')
    target = f"docker://{embedded_registry.url.removeprefix('http://')}/skopeo/demo:v1"
    skopeo = ["skopeo", "--policy", str(policy)]
    subprocess.run([*skopeo, "copy", "--dest-tls-verify=false", f"oci:{tmp_path / 'layout'}:v1", target],
                   check=True, capture_output=True, timeout=60)
    inspected = json.loads(subprocess.run([*skopeo, "inspect", "--tls-verify=false", target], check=True,
                                          capture_output=True, timeout=60).stdout)
    assert inspected["Digest"] == descriptor.digest
    assert inspected["Layers"] == [info.digest for info, _ in layers]
    assert inspected["Env"] == [f"MODEL_DIR=/{MODEL_PREFIX}"] and inspected["Labels"] == {"modelplane.model": "demo"}
    with HttpRegistry(embedded_registry.url) as registry:
        body, media_type, digest = registry.get_manifest("skopeo/demo", "v1")
        assert (digest, media_type) == (descriptor.digest, MANIFEST)
        assert body == blob_path(tmp_path / "layout", descriptor.digest).read_bytes()
        pull_image(registry, "skopeo/demo", "v1", tmp_path / "pulled")
    assert snapshot(tmp_path / "pulled") == expected_image_tree(tree)


def test_push_layout_then_pull_image_reproduces_the_tree(tree, tmp_path, embedded_registry):
    descriptor, layers = build_image(tree, tmp_path)
    with HttpRegistry(embedded_registry.url) as registry:
        pushed = push_layout(registry, tmp_path / "layout", "roundtrip/demo", "v1")
        assert push_layout(registry, tmp_path / "layout", "roundtrip/demo", "v1") == pushed
        stats = pull_image(registry, "roundtrip/demo", "v1", tmp_path / "pulled")
    assert pushed.digest == descriptor.digest
    assert snapshot(tmp_path / "pulled") == expected_image_tree(tree)
    assert stats.layers == 2 and stats.bytes_downloaded == sum(info.size for info, _ in layers)
    assert stats.download_s > 0 and stats.extract_s > 0
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".pulled")) == []


class CountingRegistry(FakeRegistry):
    def __init__(self) -> None:
        super().__init__()
        self.uploads: list[str] = []

    def push_blob(self, repo, source):
        digest, size = super().push_blob(repo, source)
        self.uploads.append(digest)
        return digest, size


def test_push_layout_sends_only_the_blobs_the_registry_lacks(tree, tmp_path):
    descriptor, layers = build_image(tree, tmp_path)
    registry = CountingRegistry()
    registry.push_blob("demo", blob_path(tmp_path / "layout", layers[0][0].digest))
    registry.uploads.clear()
    push_layout(registry, tmp_path / "layout", "demo", "v1")
    config_digest = json.loads(blob_path(tmp_path / "layout", descriptor.digest).read_bytes())["config"]["digest"]
    assert sorted(registry.uploads) == sorted([config_digest, layers[1][0].digest])
    registry.uploads.clear()
    push_layout(registry, tmp_path / "layout", "demo", "v2", ref_name="v1")
    assert registry.uploads == []
    assert registry.get_manifest("demo", "v2")[2] == descriptor.digest


def gzip_tar(entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry, data in entries:
            entry.size = len(data) if data is not None else 0
            tar.addfile(entry, io.BytesIO(data) if data is not None else None)
    return gzip.compress(raw.getvalue(), mtime=0)


def push_image(registry: FakeRegistry, repo: str, tag: str, layer_blobs: list[bytes]) -> None:
    config_digest, config_size = registry.push_blob(repo, canonical_json(ImageConfig().to_json([])))
    layers = []
    for blob in layer_blobs:
        digest, size = registry.push_blob(repo, blob)
        layers.append({"mediaType": LAYER_GZIP, "digest": digest, "size": size})
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST, "layers": layers,
                "config": {"mediaType": CONFIG, "digest": config_digest, "size": config_size}}
    registry.put_manifest(repo, tag, canonical_json(manifest), MANIFEST)


def entry(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, 0o644 if kind == tarfile.REGTYPE else 0o755
    return info


def test_pull_image_applies_layers_in_order_with_whiteouts(tmp_path):
    registry = FakeRegistry()
    lower = gzip_tar([(entry("app", tarfile.DIRTYPE), None), (entry("app/keep"), b"lower"),
                      (entry("app/replace"), b"lower"), (entry("app/delete"), b"lower"),
                      (entry("cache", tarfile.DIRTYPE), None), (entry("cache/old"), b"lower"),
                      (entry("link", tarfile.SYMTYPE, "app/keep"), None)])
    upper = gzip_tar([(entry("app/replace"), b"upper"), (entry("app/.wh.delete"), b""),
                      (entry("cache/.wh..wh..opq"), b""), (entry("link"), b"a file now")])
    push_image(registry, "layers", "v1", [lower, upper])
    pull_image(registry, "layers", "v1", tmp_path / "root")
    root = tmp_path / "root"
    assert (root / "app/keep").read_bytes() == b"lower"
    assert (root / "app/replace").read_bytes() == b"upper"
    assert not (root / "app/delete").exists() and list((root / "cache").iterdir()) == []
    assert not (root / "link").is_symlink() and (root / "link").read_bytes() == b"a file now"
    assert (root / "app/keep").read_bytes() == b"lower", "writing 'link' must not write through the old symlink"


def test_an_absolute_symlink_is_kept_as_a_path_in_the_images_root_and_never_followed(tmp_path):
    registry = FakeRegistry()
    push_image(registry, "venv", "v1", [gzip_tar([(entry("bin/python3", tarfile.SYMTYPE, "/usr/bin/python3.11"), None)])])
    pull_image(registry, "venv", "v1", tmp_path / "root")
    assert os.readlink(tmp_path / "root" / "bin" / "python3") == "/usr/bin/python3.11"


@pytest.mark.parametrize("entries", [
    [(entry("../escaped"), b"x")],
    [(entry("/abs-escaped"), b"x")],
    [(entry("etc", tarfile.SYMTYPE, "/tmp"), None), (entry("etc/escaped"), b"x")],
    [(entry("up", tarfile.SYMTYPE, "../.."), None), (entry("up/escaped"), b"x")],
], ids=["dot-dot", "absolute", "through-absolute-symlink", "symlink-out"])
def test_pull_image_refuses_layers_that_write_outside_the_destination(tmp_path, entries):
    registry = FakeRegistry()
    push_image(registry, "evil", "v1", [gzip_tar(entries)])
    (tmp_path / "deep" / "er").mkdir(parents=True)
    with pytest.raises(ValueError):
        pull_image(registry, "evil", "v1", tmp_path / "deep" / "er" / "root")
    assert not list(tmp_path.rglob("*escaped*"))
