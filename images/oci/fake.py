"""An in-memory registry with the semantics of :class:`images.oci.registry.Registry`.

For unit tests of what builds on the registry. Like the CNCF distribution registry 2.8 it
has no referrers API by default (``referrers_api=True`` gives it one); a manifest's
``subject`` is indexed either way, as a registry that has the API would.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from images.oci.registry import Descriptor, NotFound, RegistryError, check_digest, sha256_digest


class FakeRegistry:
    def __init__(self, url: str = "http://fake-registry.invalid", referrers_api: bool = False) -> None:
        self.url = url
        self.referrers_api = referrers_api
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[tuple[str, str], tuple[bytes, str]] = {}  # (repo, digest) → (body, media type)
        self.tags: dict[tuple[str, str], str] = {}  # (repo, tag) → digest
        self.range_requests: list[tuple[str, int, int]] = []  # (digest, start, length), for tests
        self._lock = threading.Lock()

    def has_blob(self, repo: str, digest: str) -> bool:
        return check_digest(digest) in self.blobs

    def push_blob(self, repo: str, source: bytes | Path) -> tuple[str, int]:
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        digest = sha256_digest(data)
        with self._lock:
            self.blobs.setdefault(digest, data)
        return digest, len(data)

    def _blob(self, digest: str) -> bytes:
        try:
            return self.blobs[check_digest(digest)]
        except KeyError:
            raise NotFound(f"blob {digest} is not in the registry") from None

    def _checked_blob(self, digest: str) -> bytes:
        """The blob, its digest checked like the HTTP adapter does (a test may corrupt ``blobs``)."""
        data = self._blob(digest)
        if sha256_digest(data) != digest:
            raise RegistryError(f"blob {digest} has digest {sha256_digest(data)}", 200)
        return data

    def get_blob(self, repo: str, digest: str) -> bytes:
        return self._checked_blob(digest)

    def download_blob(self, repo: str, digest: str, path: Path) -> int:
        data = self._checked_blob(digest)
        Path(path).write_bytes(data)
        return len(data)

    def read_blob_range(self, repo: str, digest: str, start: int, length: int) -> bytes:
        data = self._blob(digest)
        if start < 0 or length <= 0 or start >= len(data):
            raise RegistryError(f"range {start}+{length} is outside blob {digest} of {len(data)} bytes", 416)
        with self._lock:
            self.range_requests.append((digest, start, length))
        return data[start:start + length]

    def put_manifest(self, repo: str, reference: str, body: bytes, media_type: str) -> str:
        digest = sha256_digest(body)
        parsed = json.loads(body)
        for ref in [parsed.get("config"), *parsed.get("layers", [])]:
            if ref and ref["digest"] not in self.blobs:
                raise RegistryError(f"manifest refers to blob {ref['digest']}, which was not pushed", 400)
        with self._lock:
            self.manifests[(repo, digest)] = (body, media_type)
            if not reference.startswith("sha256:"):
                self.tags[(repo, reference)] = digest
            elif reference != digest:
                raise RegistryError(f"manifest pushed by digest {reference} has digest {digest}", 400)
        return digest

    def get_manifest(self, repo: str, reference: str) -> tuple[bytes, str, str]:
        digest = reference if reference.startswith("sha256:") else self.tags.get((repo, reference))
        if digest is None or (repo, digest) not in self.manifests:
            raise NotFound(f"manifest {repo}:{reference} is not in the registry")
        body, media_type = self.manifests[(repo, digest)]
        return body, media_type, digest

    def referrers(self, repo: str, digest: str) -> list[Descriptor] | None:
        if not self.referrers_api:
            return None
        found = []
        for (manifest_repo, manifest_digest), (body, media_type) in sorted(self.manifests.items()):
            parsed = json.loads(body)
            if manifest_repo == repo and (parsed.get("subject") or {}).get("digest") == digest:
                found.append(Descriptor(media_type, manifest_digest, len(body), parsed.get("annotations") or {},
                                        parsed.get("artifactType") or (parsed.get("config") or {}).get("mediaType")))
        return found

    def close(self) -> None:
        pass
