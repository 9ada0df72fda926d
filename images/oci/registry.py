"""The ``Registry`` Protocol: the part of the OCI distribution API modelplane uses.

:class:`images.oci.client.HttpRegistry` speaks it to any registry (the embedded
``docker-registry``, a cloud one) over HTTP with basic or bearer auth;
:class:`images.oci.fake.FakeRegistry` keeps blobs and manifests in memory with the same
semantics, for unit tests. Digests are ``sha256:<hex>`` strings; a blob or manifest that is
not there raises :class:`NotFound`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
EMPTY = "application/vnd.oci.empty.v1+json"
# What Docker and older registries serve; read (never written) by the client and pull_image.
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
EMPTY_JSON = b"{}"


def sha256_digest(data: bytes) -> str:
    """The OCI digest of ``data``.

    >>> sha256_digest(b"{}")
    'sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a'
    """
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_digest(digest: str) -> str:
    """The digest, or a ValueError naming what is wrong with it (only sha256 is used here)."""
    algorithm, _, hexpart = digest.partition(":")
    if algorithm != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"{digest!r} is not a sha256 digest (sha256:<64 lowercase hex digits>)")
    return digest


@dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor."""

    media_type: str
    digest: str
    size: int
    annotations: dict[str, str] = field(default_factory=dict)
    artifact_type: str | None = None

    def to_json(self) -> dict:
        out: dict = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.artifact_type:
            out["artifactType"] = self.artifact_type
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        return out

    @classmethod
    def from_json(cls, data: dict) -> Descriptor:
        return cls(data["mediaType"], check_digest(data["digest"]), int(data["size"]),
                   dict(data.get("annotations") or {}), data.get("artifactType"))


class RegistryError(Exception):
    """The registry refused or failed a request; ``status`` is its HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class NotFound(RegistryError):
    def __init__(self, message: str) -> None:
        super().__init__(message, 404)


class Registry(Protocol):
    url: str  # where it answers, e.g. http://127.0.0.1:5000

    def has_blob(self, repo: str, digest: str) -> bool: ...

    def push_blob(self, repo: str, source: bytes | Path) -> tuple[str, int]:
        """Upload a blob unless the registry has it; returns (digest, size)."""

    def get_blob(self, repo: str, digest: str) -> bytes:
        """The whole blob, its digest checked (RegistryError on mismatch)."""

    def download_blob(self, repo: str, digest: str, path: Path) -> int:
        """Stream the blob into ``path``, digest checked; returns its size."""

    def read_blob_range(self, repo: str, digest: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start`` (an HTTP Range request); not checked here."""

    def put_manifest(self, repo: str, reference: str, body: bytes, media_type: str) -> str:
        """Store a manifest or index under a tag (or its digest); returns its digest."""

    def get_manifest(self, repo: str, reference: str) -> tuple[bytes, str, str]:
        """(body, media type, digest) of a manifest by tag or digest."""

    def referrers(self, repo: str, digest: str) -> list[Descriptor] | None:
        """The manifests whose ``subject`` is ``digest``; None when the registry has no
        referrers API (callers then read the ``sha256-<hex>`` tag, OCI's fallback)."""

    def close(self) -> None: ...
