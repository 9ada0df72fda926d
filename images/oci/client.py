"""``HttpRegistry``: the :class:`images.oci.registry.Registry` Protocol over the OCI
distribution HTTP API, for the embedded ``docker-registry`` and for cloud registries.

One ``httpx.Client`` (thread-safe, a pool of ``max_connections``) serves every caller, so the
lazy fetcher's parallel range reads share connections and tokens. Authentication follows the
registry's 401 challenge: ``Basic`` gets the configured credentials, ``Bearer`` sends us to
the token endpoint (``realm``) for a token, cached per scope (repository and pull/push).

Every timeout is per network operation (connect, each read, each write): a registry that
stops answering mid-body raises :class:`RegistryError` after ``timeout_s``, never hangs.
Digests are checked on everything read whole (blobs, manifests fetched by digest); range
reads are checked by their caller, which knows the digest of the sector it asked for.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import tempfile
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import httpx

from images.oci.registry import (
    DOCKER_MANIFEST, DOCKER_MANIFEST_LIST, INDEX, MANIFEST, Descriptor, NotFound, RegistryError, check_digest,
    sha256_digest,
)

ACCEPT_MANIFESTS = ", ".join([MANIFEST, INDEX, DOCKER_MANIFEST, DOCKER_MANIFEST_LIST])
CHUNK_BYTES = 1 << 20
# The distribution spec's grammar for repository names and tags.
REPOSITORY = re.compile(r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*)*")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_CHALLENGE_PARAM = re.compile(r'(\w+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]+))')


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """The scheme (lower case) and parameters of a ``WWW-Authenticate`` header.

    >>> parse_challenge('Bearer realm="https://auth.example/token",service="reg",scope="repository:a/b:pull,push"')
    ('bearer', {'realm': 'https://auth.example/token', 'service': 'reg', 'scope': 'repository:a/b:pull,push'})
    >>> parse_challenge('Basic realm="modelplane"')
    ('basic', {'realm': 'modelplane'})
    """
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), {key.lower(): quoted if quoted or not token else token
                            for key, quoted, token in _CHALLENGE_PARAM.findall(rest)}


def upload_url(base_url: str, location: str, digest: str) -> str:
    """Where to PUT a blob: the upload's ``Location`` (absolute or relative to the registry)
    with ``digest`` added to its query.

    >>> upload_url("http://r:5000", "/v2/a/blobs/uploads/u1?_state=s", "sha256:ab")
    'http://r:5000/v2/a/blobs/uploads/u1?_state=s&digest=sha256%3Aab'
    >>> upload_url("http://r:5000", "https://cdn.example/up/u1", "sha256:ab")
    'https://cdn.example/up/u1?digest=sha256%3Aab'
    """
    absolute = urllib.parse.urljoin(base_url + "/", location)
    separator = "&" if urllib.parse.urlsplit(absolute).query else "?"
    return f"{absolute}{separator}digest={urllib.parse.quote(digest, safe='')}"


def error_message(body: bytes) -> str:
    """The registry's reason from an OCI error document, else the start of the body.

    >>> error_message(b'{"errors":[{"code":"BLOB_UNKNOWN","message":"blob unknown to registry"}]}')
    'BLOB_UNKNOWN: blob unknown to registry'
    >>> error_message(b'404 page not found')
    '404 page not found'
    """
    try:
        first = json.loads(body)["errors"][0]
        return ": ".join(str(part) for part in (first.get("code"), first.get("message")) if part)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return body[:200].decode(errors="replace").strip()


def file_digest(path: Path) -> tuple[str, int]:
    """(sha256 digest, size) of a file, read in chunks: a GB file is never in memory."""
    with open(path, "rb") as source:
        return "sha256:" + hashlib.file_digest(source, "sha256").hexdigest(), os.fstat(source.fileno()).st_size


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as source:
        while chunk := source.read(CHUNK_BYTES):
            yield chunk


def _repository(repo: str) -> str:
    if not REPOSITORY.fullmatch(repo):
        raise ValueError(f"{repo!r} is not a repository name (lower-case path components like 'modelplane/model')")
    return repo


def _reference(reference: str) -> str:
    if reference.startswith("sha256:"):
        return check_digest(reference)
    if not TAG.fullmatch(reference):
        raise ValueError(f"{reference!r} is neither a tag nor a sha256 digest")
    return reference


class HttpRegistry:
    """A registry at ``url`` (``http://127.0.0.1:5000``, ``https://ghcr.io``)."""

    def __init__(self, url: str, *, username: str | None = None, password: str | None = None,
                 timeout_s: float = 30.0, connect_timeout_s: float = 5.0, max_connections: int = 16) -> None:
        self.url = url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"registry url {url!r} must start with http:// or https://")
        self.timeout_s = timeout_s
        self._credentials = (username, password or "") if username is not None else None
        self._client = httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            headers={"User-Agent": "modelplane-images"},
        )
        self._lock = threading.Lock()
        self._tokens: dict[str, str] = {}  # scope → bearer token
        self._basic = False  # the registry asked for basic auth: send it with every request

    # -- requests, auth and errors ---------------------------------------------------------

    def _authorization(self, scope: str) -> str | None:
        with self._lock:
            token = self._tokens.get(scope)
            basic = self._basic
        if token:
            return f"Bearer {token}"
        if basic and self._credentials:
            return "Basic " + base64.b64encode(":".join(self._credentials).encode()).decode()
        return None

    def _send(self, method: str, url: str, scope: str, *, headers: dict[str, str] | None = None,
              content: bytes | Callable[[], Iterable[bytes]] | None = None, stream: bool = False,
              follow_redirects: bool = False) -> httpx.Response:
        """One request, retried once after answering a 401 challenge. ``content`` may be a
        factory, so a streamed upload can be sent again from its start."""
        for attempt in range(2):
            request_headers = dict(headers or {})
            authorization = self._authorization(scope)
            if authorization:
                request_headers["Authorization"] = authorization  # httpx drops it on a cross-origin redirect
            body = content() if callable(content) else content
            try:
                request = self._client.build_request(method, url, headers=request_headers, content=body)
                response = self._client.send(request, stream=stream, follow_redirects=follow_redirects)
            except httpx.HTTPError as exc:
                raise RegistryError(f"{method} {url} failed: {type(exc).__name__}: {exc}", 0) from exc
            if response.status_code != 401 or attempt == 1:
                return response
            challenge = response.headers.get("WWW-Authenticate", "")
            try:
                response.read()  # small: an error document; keeps it readable after close
            except httpx.HTTPError:
                pass
            response.close()
            if not self._answer(challenge, scope, authorization):
                return response
        raise AssertionError("unreachable")

    def _answer(self, challenge: str, scope: str, sent: str | None) -> bool:
        """Learn how to authenticate from a 401; True when a retry can succeed."""
        scheme, params = parse_challenge(challenge)
        if scheme == "basic":
            if self._credentials is None:
                raise RegistryError(f"{self.url} needs credentials (basic auth): pass username and password", 401)
            if sent and sent.startswith("Basic "):
                return False  # these credentials were just refused
            with self._lock:
                self._basic = True
            return True
        if scheme == "bearer" and params.get("realm"):
            token = self._fetch_token(params["realm"], params.get("service"), params.get("scope") or scope)
            with self._lock:
                self._tokens[scope] = token
            return True
        return False

    def _fetch_token(self, realm: str, service: str | None, scope: str) -> str:
        query = {key: value for key, value in (("service", service), ("scope", scope)) if value}
        try:
            response = self._client.get(realm, params=query, auth=self._credentials, follow_redirects=True)
        except httpx.HTTPError as exc:
            raise RegistryError(f"GET {realm} (token) failed: {type(exc).__name__}: {exc}", 0) from exc
        if response.status_code in (401, 403):
            needs = "rejected the credentials" if self._credentials else "needs credentials: pass username and password"
            raise RegistryError(f"token endpoint {realm} {needs} (scope {scope!r}): {error_message(response.content)}",
                                response.status_code)
        self._check(response, f"token from {realm}")
        try:
            answer = response.json()
            return answer.get("token") or answer["access_token"]
        except (ValueError, KeyError, AttributeError) as exc:
            raise RegistryError(f"token endpoint {realm} answered without a token", response.status_code) from exc

    def _check(self, response: httpx.Response, what: str) -> httpx.Response:
        """The response when 2xx; else NotFound (404) or RegistryError with the registry's reason."""
        if 200 <= response.status_code < 300:
            return response
        try:
            body = response.read()
        except httpx.HTTPError:
            body = b""
        finally:
            response.close()
        message = f"{what}: HTTP {response.status_code}: {error_message(body)}"
        if response.status_code == 404:
            raise NotFound(message)
        if response.status_code == 401:
            message += (" (the credentials were refused or lack this permission)" if self._credentials
                        else " (it needs credentials: pass username and password)")
        raise RegistryError(message, response.status_code)

    def _read_stream(self, response: httpx.Response, url: str) -> Iterator[bytes]:
        try:
            yield from response.iter_bytes(CHUNK_BYTES)
        except httpx.HTTPError as exc:
            raise RegistryError(f"reading {url} failed: {type(exc).__name__}: {exc}", 0) from exc
        finally:
            response.close()

    def _blob_url(self, repo: str, digest: str) -> str:
        return f"{self.url}/v2/{_repository(repo)}/blobs/{check_digest(digest)}"

    # -- the Registry Protocol -------------------------------------------------------------

    def has_blob(self, repo: str, digest: str) -> bool:
        url = self._blob_url(repo, digest)
        response = self._send("HEAD", url, f"repository:{repo}:pull", follow_redirects=True)
        if response.status_code == 404:
            return False
        self._check(response, f"HEAD {url}")
        return True

    def push_blob(self, repo: str, source: bytes | Path) -> tuple[str, int]:
        if isinstance(source, bytes):
            digest, size = sha256_digest(source), len(source)
            content: Callable[[], Iterable[bytes]] | bytes = source
        else:
            path = Path(source)
            digest, size = file_digest(path)
            content = lambda: _file_chunks(path)  # noqa: E731 - a fresh stream per attempt
        if self.has_blob(repo, digest):
            return digest, size
        scope = f"repository:{repo}:pull,push"
        started = self._check(self._send("POST", f"{self.url}/v2/{_repository(repo)}/blobs/uploads/", scope,
                                         content=b""), f"starting the upload of {digest} to {repo}")
        location = started.headers.get("Location")
        if not location:
            raise RegistryError(f"{self.url} started an upload to {repo} without a Location header",
                                started.status_code)
        url = upload_url(self.url, location, digest)
        done = self._check(self._send("PUT", url, scope, content=content, headers={
            "Content-Type": "application/octet-stream", "Content-Length": str(size)}), f"uploading {digest} to {repo}")
        stored = done.headers.get("Docker-Content-Digest")
        if stored and stored != digest:
            raise RegistryError(f"{self.url} stored blob {digest} as {stored}", done.status_code)
        return digest, size

    def get_blob(self, repo: str, digest: str) -> bytes:
        url = self._blob_url(repo, digest)
        response = self._send("GET", url, f"repository:{repo}:pull", follow_redirects=True)
        data = self._check(response, f"GET {url}").content
        if sha256_digest(data) != digest:
            raise RegistryError(f"blob {digest} from {self.url}/{repo} has digest {sha256_digest(data)}", 200)
        return data

    def download_blob(self, repo: str, digest: str, path: Path) -> int:
        """Stream into a temporary file beside ``path``, check the digest, rename; nothing is
        left at ``path`` or beside it when the download or the check fails."""
        path = Path(path)
        url = self._blob_url(repo, digest)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        try:
            sha256, size = hashlib.sha256(), 0
            with os.fdopen(descriptor, "wb") as out:
                response = self._check(self._send("GET", url, f"repository:{repo}:pull", stream=True,
                                                  follow_redirects=True), f"GET {url}")
                for chunk in self._read_stream(response, url):
                    sha256.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
            if "sha256:" + sha256.hexdigest() != digest:
                raise RegistryError(f"blob {digest} from {self.url}/{repo} has digest sha256:{sha256.hexdigest()}", 200)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return size

    def read_blob_range(self, repo: str, digest: str, start: int, length: int) -> bytes:
        if start < 0 or length <= 0:
            raise RegistryError(f"range {start}+{length} of blob {digest} is empty or negative", 416)
        url = self._blob_url(repo, digest)
        response = self._send("GET", url, f"repository:{repo}:pull", stream=True, follow_redirects=True,
                              headers={"Range": f"bytes={start}-{start + length - 1}"})
        if response.status_code not in (200, 206):
            self._check(response, f"GET {url} bytes {start}+{length}")
        data = bytearray()
        for chunk in self._read_stream(response, url):  # stop early: a 200 may be the whole blob
            data += chunk
            if len(data) > length:
                response.close()
                break
        if len(data) > length or (response.status_code == 200 and (start != 0 or len(data) != length)):
            raise RegistryError(f"{self.url} ignored the Range header for {url} (HTTP {response.status_code})",
                                response.status_code)
        return bytes(data)

    def put_manifest(self, repo: str, reference: str, body: bytes, media_type: str) -> str:
        url = f"{self.url}/v2/{_repository(repo)}/manifests/{_reference(reference)}"
        self._check(self._send("PUT", url, f"repository:{repo}:pull,push", content=body,
                               headers={"Content-Type": media_type}), f"PUT {url}")
        return sha256_digest(body)

    def get_manifest(self, repo: str, reference: str) -> tuple[bytes, str, str]:
        url = f"{self.url}/v2/{_repository(repo)}/manifests/{_reference(reference)}"
        response = self._check(self._send("GET", url, f"repository:{repo}:pull", follow_redirects=True,
                                          headers={"Accept": ACCEPT_MANIFESTS}), f"GET {url}")
        body = response.content
        media_type = response.headers.get("Content-Type", "").split(";")[0].strip()
        if media_type in ("", "application/json", "text/plain"):
            media_type = json.loads(body).get("mediaType", media_type)
        if reference.startswith("sha256:"):
            if sha256_digest(body) != reference:
                raise RegistryError(f"manifest {reference} from {url} has digest {sha256_digest(body)}", 200)
            return body, media_type, reference
        return body, media_type, response.headers.get("Docker-Content-Digest") or sha256_digest(body)

    def referrers(self, repo: str, digest: str) -> list[Descriptor] | None:
        url = f"{self.url}/v2/{_repository(repo)}/referrers/{check_digest(digest)}"
        response = self._send("GET", url, f"repository:{repo}:pull", follow_redirects=True,
                              headers={"Accept": INDEX})
        if response.status_code == 404:  # no referrers API (distribution 2.8): callers use the tag
            return None
        index = json.loads(self._check(response, f"GET {url}").content)
        return [Descriptor.from_json(entry) for entry in index.get("manifests") or []]

    def tags(self, repo: str) -> list[str]:
        """Every tag of ``repo``, following the registry's ``Link`` pagination."""
        url: str | None = f"{self.url}/v2/{_repository(repo)}/tags/list"
        found: list[str] = []
        while url:
            response = self._check(self._send("GET", url, f"repository:{repo}:pull"), f"GET {url}")
            found += response.json().get("tags") or []
            following = response.links.get("next", {}).get("url")
            url = urllib.parse.urljoin(self.url + "/", following) if following else None
        return found

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> HttpRegistry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
