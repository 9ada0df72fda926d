"""The seekable artifact in a registry: pushed next to an image, found from the image's digest."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from images.oci.fake import FakeRegistry
from images.oci.registry import EMPTY, INDEX, MANIFEST, Descriptor, NotFound, sha256_digest
from images.seekable.artifact import (CREATED_ANNOTATION, LAYER_DIGEST_ANNOTATION, MOUNT_ANNOTATION,
                                      BadSeekableArtifact, SeekableLayer, fallback_tag, fetch_index, find_seekable,
                                      push_seekable)
from images.seekable.build import cut_sectors
from images.seekable.index import ARTIFACT_TYPE, DATA_MEDIA_TYPE, INDEX_MEDIA_TYPE

REPO = "models/llama"


def push_image(registry: FakeRegistry, tag: str = "v1") -> Descriptor:
    """An ordinary image: a config and one layer blob, its manifest under a tag."""
    config, config_size = registry.push_blob(REPO, b'{"architecture":"amd64","os":"linux"}')
    layer, layer_size = registry.push_blob(REPO, b"pretend this is a tar.gz " + tag.encode())
    body = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST,
                       "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config,
                                  "size": config_size},
                       "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer,
                                   "size": layer_size}]}).encode()
    return Descriptor(MANIFEST, registry.put_manifest(REPO, tag, body, MANIFEST), len(body))


def seekable_layer(tmp_path: Path, seed: int, mount: str = "/") -> SeekableLayer:
    image = tmp_path / f"image-{seed}"
    image.write_bytes(random.Random(seed).randbytes(10000) + bytes(8192) + b"model" * 3000)
    index = cut_sectors(image, tmp_path / f"data-{seed}", sector_bytes=4096)
    return SeekableLayer(index, tmp_path / f"data-{seed}",
                         {LAYER_DIGEST_ANNOTATION: sha256_digest(b"layer %d" % seed), MOUNT_ANNOTATION: mount})


@pytest.mark.parametrize("referrers_api", [True, False])
def test_push_then_find_then_fetch_gives_back_each_layer(tmp_path, referrers_api):
    registry = FakeRegistry(referrers_api=referrers_api)
    subject = push_image(registry)
    layers = [seekable_layer(tmp_path, 1, "/"), seekable_layer(tmp_path, 2, "/models")]
    pushed = push_seekable(registry, REPO, subject, layers)

    found = find_seekable(registry, REPO, subject.digest)
    assert found is not None and found.manifest_digest == pushed.digest
    assert [ref.annotations for ref in found.layers] == [layer.annotations for layer in layers]
    for ref, layer in zip(found.layers, layers, strict=True):
        assert fetch_index(registry, REPO, ref) == layer.index
        assert (ref.data_digest, ref.data_size) == (layer.index.data_digest, layer.data_path.stat().st_size)
        assert registry.get_blob(REPO, ref.data_digest) == layer.data_path.read_bytes()
    # Only a registry without the referrers API gets the fallback tag.
    assert ((REPO, fallback_tag(subject.digest)) in registry.tags) is not referrers_api


def test_the_manifest_is_an_artifact_that_refers_to_the_image(tmp_path):
    registry = FakeRegistry()
    subject = push_image(registry)
    layer = seekable_layer(tmp_path, 1)
    pushed = push_seekable(registry, REPO, subject, [layer], annotations={CREATED_ANNOTATION: "2026-01-02T03:04:05Z"})
    body, media_type, digest = registry.get_manifest(REPO, pushed.digest)
    manifest = json.loads(body)
    assert (media_type, digest, pushed.size) == (MANIFEST, sha256_digest(body), len(body))
    assert manifest["artifactType"] == ARTIFACT_TYPE
    assert manifest["config"] == {"mediaType": EMPTY, "digest": sha256_digest(b"{}"), "size": 2}
    assert [d["mediaType"] for d in manifest["layers"]] == [INDEX_MEDIA_TYPE, DATA_MEDIA_TYPE]
    assert manifest["layers"][0]["annotations"] == layer.annotations
    assert manifest["layers"][0]["digest"] == sha256_digest(layer.index.to_json())
    assert manifest["subject"] == {"mediaType": MANIFEST, "digest": subject.digest, "size": subject.size}
    assert manifest["annotations"] == {CREATED_ANNOTATION: "2026-01-02T03:04:05Z"}


def test_the_fallback_tag_lists_every_referrer_once(tmp_path):
    registry = FakeRegistry()
    subject = push_image(registry)
    first = push_seekable(registry, REPO, subject, [seekable_layer(tmp_path, 1)])
    second = push_seekable(registry, REPO, subject, [seekable_layer(tmp_path, 2)], annotations={"note": "rebuilt"})
    push_seekable(registry, REPO, subject, [seekable_layer(tmp_path, 1)])  # the first again: no new entry

    body, media_type, _ = registry.get_manifest(REPO, "sha256-" + subject.digest.removeprefix("sha256:"))
    listed = json.loads(body)
    assert media_type == INDEX and listed["mediaType"] == INDEX
    assert listed["manifests"] == [
        {"mediaType": MANIFEST, "digest": first.digest, "size": first.size, "artifactType": ARTIFACT_TYPE},
        {"mediaType": MANIFEST, "digest": second.digest, "size": second.size, "artifactType": ARTIFACT_TYPE,
         "annotations": {"note": "rebuilt"}},
    ]
    assert find_seekable(registry, REPO, subject.digest).manifest_digest == second.digest  # the last pushed


@pytest.mark.parametrize("referrers_api", [True, False])
def test_the_newest_by_created_annotation_wins(tmp_path, referrers_api):
    registry = FakeRegistry(referrers_api=referrers_api)
    subject = push_image(registry)
    newer = push_seekable(registry, REPO, subject, [seekable_layer(tmp_path, 1)],
                          annotations={CREATED_ANNOTATION: "2026-05-01T00:00:00Z"})
    push_seekable(registry, REPO, subject, [seekable_layer(tmp_path, 2)],
                  annotations={CREATED_ANNOTATION: "2026-04-01T00:00:00Z"})
    assert find_seekable(registry, REPO, subject.digest).manifest_digest == newer.digest


def test_other_referrers_in_the_fallback_tag_are_kept_and_ignored(tmp_path):
    registry = FakeRegistry()
    subject = push_image(registry)
    signature = Descriptor(MANIFEST, sha256_digest(b"a signature"), 11, {},
                           "application/vnd.dev.cosign.artifact.sig.v1+json")
    tag = fallback_tag(subject.digest)
    registry.put_manifest(REPO, tag, json.dumps({"schemaVersion": 2, "mediaType": INDEX,
                                                 "manifests": [signature.to_json()]}).encode(), INDEX)
    assert find_seekable(registry, REPO, subject.digest) is None

    pushed = push_seekable(registry, REPO, subject, [seekable_layer(tmp_path, 1)])
    listed = [d["digest"] for d in json.loads(registry.get_manifest(REPO, tag)[0])["manifests"]]
    assert listed == [signature.digest, pushed.digest]
    assert find_seekable(registry, REPO, subject.digest).manifest_digest == pushed.digest


@pytest.mark.parametrize("referrers_api", [True, False])
def test_an_image_without_a_seekable_form_has_none(referrers_api):
    registry = FakeRegistry(referrers_api=referrers_api)
    assert find_seekable(registry, REPO, push_image(registry).digest) is None


def artifact_with_layers(registry: FakeRegistry, subject: Descriptor, layers: list[Descriptor]) -> None:
    """A referrer that claims the seekable artifact type, with whatever layers it is given."""
    registry.push_blob(REPO, b"{}")
    body = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST, "artifactType": ARTIFACT_TYPE,
                       "config": {"mediaType": EMPTY, "digest": sha256_digest(b"{}"), "size": 2},
                       "layers": [d.to_json() for d in layers], "subject": subject.to_json()}).encode()
    registry.put_manifest(REPO, sha256_digest(body), body, MANIFEST)


@pytest.mark.parametrize(("media_types", "message"), [
    ([INDEX_MEDIA_TYPE, "application/vnd.oci.image.layer.v1.tar+gzip"], "found media types"),
    ([DATA_MEDIA_TYPE, INDEX_MEDIA_TYPE], "found media types"),
    ([DATA_MEDIA_TYPE], "an index or its data is missing"),
])
def test_a_misshapen_artifact_is_reported(media_types, message):
    registry = FakeRegistry(referrers_api=True)
    subject = push_image(registry)
    blobs = [Descriptor(media_type, *registry.push_blob(REPO, b"blob %d" % n))
             for n, media_type in enumerate(media_types)]
    artifact_with_layers(registry, subject, blobs)
    with pytest.raises(BadSeekableArtifact, match=message):
        find_seekable(registry, REPO, subject.digest)


def test_a_missing_index_blob_is_reported(tmp_path):
    registry = FakeRegistry()
    subject = push_image(registry)
    push_seekable(registry, REPO, subject, [seekable_layer(tmp_path, 1)])
    (ref,) = find_seekable(registry, REPO, subject.digest).layers
    del registry.blobs[ref.index_digest]
    with pytest.raises(NotFound, match="seekable index .* is missing"):
        fetch_index(registry, REPO, ref)


def test_an_index_paired_with_other_data_is_refused(tmp_path):
    registry = FakeRegistry(referrers_api=True)
    subject = push_image(registry)
    one, two = seekable_layer(tmp_path, 1), seekable_layer(tmp_path, 2)
    index_blob = Descriptor(INDEX_MEDIA_TYPE, *registry.push_blob(REPO, one.index.to_json()))
    data_blob = Descriptor(DATA_MEDIA_TYPE, *registry.push_blob(REPO, two.data_path))
    artifact_with_layers(registry, subject, [index_blob, data_blob])
    (ref,) = find_seekable(registry, REPO, subject.digest).layers
    with pytest.raises(BadSeekableArtifact, match="describes data"):
        fetch_index(registry, REPO, ref)


def test_pushing_data_its_index_does_not_describe_is_refused(tmp_path):
    registry = FakeRegistry()
    one, two = seekable_layer(tmp_path, 1), seekable_layer(tmp_path, 2)
    with pytest.raises(ValueError, match="its index describes data"):
        push_seekable(registry, REPO, push_image(registry), [SeekableLayer(one.index, two.data_path)])


def test_a_fallback_tag_that_is_not_an_index_is_reported(tmp_path):
    registry = FakeRegistry()
    subject = push_image(registry)
    other = push_image(registry, "v2")
    body, _, _ = registry.get_manifest(REPO, other.digest)
    registry.put_manifest(REPO, fallback_tag(subject.digest), body, MANIFEST)
    with pytest.raises(BadSeekableArtifact, match="not the image index of referrers"):
        find_seekable(registry, REPO, subject.digest)
    with pytest.raises(BadSeekableArtifact, match="not the image index of referrers"):
        push_seekable(registry, REPO, subject, [seekable_layer(tmp_path, 1)])
