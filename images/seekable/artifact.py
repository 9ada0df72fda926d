"""The seekable form of an image as an OCI artifact that refers to the image.

One manifest per image: ``artifactType`` :data:`ARTIFACT_TYPE`, the empty config, and for
each seekable layer its index blob then its data blob; ``subject`` is the ordinary image's
manifest, so a registry with the OCI 1.1 referrers API lists it under the image. The
registry modelplane embeds (docker-registry 2.8) has no such API, so the push also keeps
OCI's fallback: the tag ``sha256-<hex of the image digest>`` holds an image index listing
every referrer of the image. The tag is read, extended and written back; two pushes racing
on one image can drop one entry (the spec's own caveat), and a later push restores it.

Manifest and index bodies are built and parsed by pure functions; only :func:`push_seekable`,
:func:`find_seekable` and :func:`fetch_index` talk to the registry.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from images.oci.registry import (EMPTY, EMPTY_JSON, INDEX, MANIFEST, Descriptor, NotFound, Registry,
                                 check_digest, sha256_digest)
from images.seekable.index import ARTIFACT_TYPE, DATA_MEDIA_TYPE, INDEX_MEDIA_TYPE, SectorIndex

LAYER_DIGEST_ANNOTATION = "org.modelplane.layer.digest"  # the ordinary OCI layer it mirrors
MOUNT_ANNOTATION = "org.modelplane.mount"  # where its tree goes
CREATED_ANNOTATION = "org.opencontainers.image.created"  # RFC 3339; the newest artifact wins


class BadSeekableArtifact(ValueError):
    """A referrer that claims to be a seekable image but is not laid out as one."""


@dataclass(frozen=True)
class SeekableLayer:
    """One built layer, ready to push: its index and the file of its stored sectors."""

    index: SectorIndex
    data_path: Path
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SeekableLayerRef:
    """Where one pushed layer is: enough to fetch its index and range-read its sectors."""

    index_digest: str
    index_size: int
    data_digest: str
    data_size: int
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SeekableRef:
    manifest_digest: str
    layers: tuple[SeekableLayerRef, ...]
    annotations: dict[str, str] = field(default_factory=dict)


def fallback_tag(subject_digest: str) -> str:
    """The tag OCI 1.1 clients use for a subject's referrers when there is no referrers API.

    >>> fallback_tag("sha256:" + "ab" * 32) == "sha256-" + "ab" * 32
    True
    """
    return check_digest(subject_digest).replace(":", "-", 1)


def _stored_bytes(index: SectorIndex) -> int:
    return max((s.offset + s.length for s in index.sectors), default=0)


def _dumps(document: dict) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


def seekable_manifest(subject: Descriptor, layers: Sequence[tuple[Descriptor, Descriptor]],
                      annotations: Mapping[str, str] | None = None) -> bytes:
    """The artifact manifest's body: (index, data) descriptor pairs in layer order."""
    document: dict = {
        "schemaVersion": 2, "mediaType": MANIFEST, "artifactType": ARTIFACT_TYPE,
        "config": Descriptor(EMPTY, sha256_digest(EMPTY_JSON), len(EMPTY_JSON)).to_json(),
        "layers": [d.to_json() for pair in layers for d in pair],
        "subject": Descriptor(subject.media_type, subject.digest, subject.size).to_json(),
    }
    if annotations:
        document["annotations"] = dict(annotations)
    return _dumps(document)


def add_referrer(index_body: bytes | None, referrer: Descriptor) -> bytes | None:
    """The fallback tag's image index with ``referrer`` added, or None when it is there already.

    Entries other tools put there (signatures, SBOMs) are kept as they are.
    """
    if index_body is None:
        document: dict = {"schemaVersion": 2, "mediaType": INDEX, "manifests": []}
    else:
        document = json.loads(index_body)
        if not isinstance(document, dict) or not isinstance(document.get("manifests"), list):
            raise BadSeekableArtifact("the referrers fallback tag holds something other than an image index")
    if any(entry.get("digest") == referrer.digest for entry in document["manifests"]):
        return None
    document["manifests"].append(referrer.to_json())
    return _dumps(document)


def referrers_from_index(index_body: bytes) -> list[Descriptor]:
    """The descriptors an image index (the fallback tag's) lists."""
    try:
        document = json.loads(index_body)
        return [Descriptor.from_json(entry) for entry in document["manifests"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise BadSeekableArtifact(f"the referrers fallback tag is not a valid image index: {exc!r}") from None


def newest_seekable(referrers: Sequence[Descriptor]) -> Descriptor | None:
    """The seekable artifact to use among an image's referrers.

    The one with the latest ``org.opencontainers.image.created`` annotation; between equals
    (or none annotated) the one listed last, since the fallback tag lists in push order.
    """
    candidates = [(d.annotations.get(CREATED_ANNOTATION, ""), position, d)
                  for position, d in enumerate(referrers) if d.artifact_type == ARTIFACT_TYPE]
    return max(candidates, key=lambda c: c[:2])[2] if candidates else None


def parse_seekable_manifest(body: bytes, media_type: str, digest: str, image_digest: str) -> SeekableRef:
    """The layers of a seekable artifact's manifest; BadSeekableArtifact naming what is off."""
    if media_type != MANIFEST:
        raise BadSeekableArtifact(f"referrer {digest} has media type {media_type}, not an OCI manifest ({MANIFEST})")
    try:
        document = json.loads(body)
        layers = [Descriptor.from_json(d) for d in document.get("layers", [])]
        subject = (document.get("subject") or {}).get("digest")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BadSeekableArtifact(f"referrer {digest} is not a valid OCI manifest: {exc!r}") from None
    if document.get("artifactType") != ARTIFACT_TYPE:
        raise BadSeekableArtifact(f"referrer {digest} has artifactType {document.get('artifactType')!r}, "
                                  f"not {ARTIFACT_TYPE}")
    if subject != image_digest:
        raise BadSeekableArtifact(f"referrer {digest} refers to {subject}, not to the image {image_digest}")
    if len(layers) % 2:
        raise BadSeekableArtifact(f"seekable artifact {digest} has {len(layers)} layers; "
                                  f"expected (index, data) pairs: an index or its data is missing")
    refs = []
    for number in range(0, len(layers), 2):
        index, data = layers[number], layers[number + 1]
        if (index.media_type, data.media_type) != (INDEX_MEDIA_TYPE, DATA_MEDIA_TYPE):
            raise BadSeekableArtifact(
                f"seekable artifact {digest}, layer pair {number // 2}: found media types {index.media_type} "
                f"and {data.media_type}; expected {INDEX_MEDIA_TYPE} then {DATA_MEDIA_TYPE}")
        refs.append(SeekableLayerRef(index.digest, index.size, data.digest, data.size, dict(index.annotations)))
    return SeekableRef(digest, tuple(refs), dict(document.get("annotations") or {}))


def push_seekable(registry: Registry, repo: str, subject: Descriptor, layers: Sequence[SeekableLayer], *,
                  annotations: Mapping[str, str] | None = None) -> Descriptor:
    """Push the layers' blobs and the artifact manifest (by digest), then list it under the image.

    The fallback tag is written only when the registry has no referrers API. Pushing the
    same artifact again changes nothing. Returns the manifest's descriptor.
    """
    pairs = []
    for number, layer in enumerate(layers):
        data_digest, data_size = registry.push_blob(repo, Path(layer.data_path))
        if data_digest != layer.index.data_digest:
            raise ValueError(f"layer {number}: {layer.data_path} has digest {data_digest}, but its index "
                             f"describes data {layer.index.data_digest or '(none)'}")
        if data_size != _stored_bytes(layer.index):
            raise ValueError(f"layer {number}: {layer.data_path} holds {data_size} bytes; its index "
                             f"places sectors up to byte {_stored_bytes(layer.index)}")
        index_body = layer.index.to_json()
        index_digest, index_size = registry.push_blob(repo, index_body)
        pairs.append((Descriptor(INDEX_MEDIA_TYPE, index_digest, index_size, dict(layer.annotations)),
                      Descriptor(DATA_MEDIA_TYPE, data_digest, data_size)))
    registry.push_blob(repo, EMPTY_JSON)
    body = seekable_manifest(subject, pairs, annotations)
    digest = registry.put_manifest(repo, sha256_digest(body), body, MANIFEST)
    referrer = Descriptor(MANIFEST, digest, len(body), dict(annotations or {}), ARTIFACT_TYPE)
    if registry.referrers(repo, subject.digest) is None:
        tag = fallback_tag(subject.digest)
        try:
            existing, media_type, _ = registry.get_manifest(repo, tag)
        except NotFound:
            existing, media_type = None, INDEX
        if media_type != INDEX:
            raise BadSeekableArtifact(f"{repo}:{tag} holds a {media_type}, not the image index of referrers")
        updated = add_referrer(existing, referrer)
        if updated is not None:
            registry.put_manifest(repo, tag, updated, INDEX)
    return referrer


def find_seekable(registry: Registry, repo: str, image_digest: str) -> SeekableRef | None:
    """The image's seekable artifact, or None when it has none (then pull it the ordinary way)."""
    referrers = registry.referrers(repo, image_digest)
    if referrers is None:
        try:
            body, media_type, _ = registry.get_manifest(repo, fallback_tag(image_digest))
        except NotFound:
            return None
        if media_type != INDEX:
            raise BadSeekableArtifact(f"{repo}:{fallback_tag(image_digest)} holds a {media_type}, "
                                      f"not the image index of referrers")
        referrers = referrers_from_index(body)
    chosen = newest_seekable(referrers)
    if chosen is None:
        return None
    body, media_type, digest = registry.get_manifest(repo, chosen.digest)
    return parse_seekable_manifest(body, media_type, digest, image_digest)


def fetch_index(registry: Registry, repo: str, layer: SeekableLayerRef) -> SectorIndex:
    """A layer's index, checked against the layer: it must describe the data blob pushed with it."""
    try:
        body = registry.get_blob(repo, layer.index_digest)
    except NotFound as exc:
        raise NotFound(f"the seekable index {layer.index_digest} of layer {layer.annotations or layer.data_digest} "
                       f"is missing from {repo}: {exc}") from exc
    index = SectorIndex.from_json(body)
    if index.data_digest != layer.data_digest:
        raise BadSeekableArtifact(f"index {layer.index_digest} describes data {index.data_digest or '(none)'}, "
                                  f"but the artifact pairs it with {layer.data_digest}")
    if _stored_bytes(index) != layer.data_size:
        raise BadSeekableArtifact(f"index {layer.index_digest} places sectors up to byte {_stored_bytes(index)}, "
                                  f"but data {layer.data_digest} holds {layer.data_size} bytes")
    return index
