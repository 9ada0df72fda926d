"""The Registry Protocol: one contract for FakeRegistry and HttpRegistry on the real
docker-registry, then what only the HTTP adapter has (auth, timeouts, streaming uploads) and
the embedded registry's own behaviour."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from images.oci.client import HttpRegistry, parse_challenge, upload_url
from images.oci.fake import FakeRegistry
from images.oci.layout import canonical_json
from images.oci.registry import (
    EMPTY, EMPTY_JSON, LAYER_GZIP, MANIFEST, NotFound, Registry, RegistryError, sha256_digest,
)
from images.oci.server import EmbeddedRegistry, bcrypt_htpasswd_line
from tests.conftest import free_port, wait_for
from tests.oci_fixtures import (  # noqa: F401 - fixtures
    PASSWORD, USER, embedded_registry, skip_without_registry_binary, stalling_server, token_registry,
)

BLOB = bytes(range(256)) * 40 + b"tail"  # 10,244 bytes


@dataclass
class Backend:
    registry: Registry
    tamper: Callable[[str], None]  # corrupt a stored blob's bytes, keeping its length


def flipped(data: bytes) -> bytes:
    return bytes([data[0] ^ 1]) + data[1:]


@pytest.fixture(params=["fake", "http"])
def backend(request):
    if request.param == "fake":
        fake = FakeRegistry()
        yield Backend(fake, lambda digest: fake.blobs.__setitem__(digest, flipped(fake.blobs[digest])))
        return
    embedded = request.getfixturevalue("embedded_registry")

    def tamper(digest: str) -> None:
        path = embedded.blob_data_path(digest)
        path.write_bytes(flipped(path.read_bytes()))

    with HttpRegistry(embedded.url, timeout_s=10.0) as registry:
        yield Backend(registry, tamper)


@pytest.fixture
def repo() -> str:
    return f"contract/{uuid.uuid4().hex[:10]}"


def push_image_manifest(registry: Registry, repo: str, tag: str, layer: bytes = BLOB) -> tuple[bytes, str]:
    config_digest, config_size = registry.push_blob(repo, EMPTY_JSON)
    layer_digest, layer_size = registry.push_blob(repo, layer)
    body = canonical_json({"schemaVersion": 2, "mediaType": MANIFEST,
                           "config": {"mediaType": EMPTY, "digest": config_digest, "size": config_size},
                           "layers": [{"mediaType": LAYER_GZIP, "digest": layer_digest, "size": layer_size}]})
    return body, registry.put_manifest(repo, tag, body, MANIFEST)


# -- the contract: the same assertions against the fake and the real registry -------------

@pytest.mark.parametrize("as_path", [False, True], ids=["bytes", "path"])
def test_pushing_a_blob_twice_gives_the_same_digest_and_stores_it_once(backend, repo, tmp_path, as_path):
    source = BLOB
    if as_path:
        source = tmp_path / "blob"
        source.write_bytes(BLOB)
    assert not backend.registry.has_blob(repo, sha256_digest(BLOB))
    first = backend.registry.push_blob(repo, source)
    assert first == (sha256_digest(BLOB), len(BLOB))
    assert backend.registry.push_blob(repo, source) == first
    assert backend.registry.has_blob(repo, first[0])
    assert backend.registry.get_blob(repo, first[0]) == BLOB


def test_an_unknown_blob_is_not_found(backend, repo, tmp_path):
    unknown = sha256_digest(b"never pushed " + uuid.uuid4().bytes)
    assert not backend.registry.has_blob(repo, unknown)
    with pytest.raises(NotFound):
        backend.registry.get_blob(repo, unknown)
    with pytest.raises(NotFound):
        backend.registry.read_blob_range(repo, unknown, 0, 10)
    with pytest.raises(NotFound):
        backend.registry.download_blob(repo, unknown, tmp_path / "blob")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("start", "length"), [(0, len(BLOB)), (0, 1), (1000, 4096), (len(BLOB) - 4, 4),
                                               (len(BLOB) - 1, 1), (8192, 2048)])
def test_a_range_read_returns_those_bytes_of_the_blob(backend, repo, start, length):
    digest, _ = backend.registry.push_blob(repo, BLOB)
    assert backend.registry.read_blob_range(repo, digest, start, length) == BLOB[start:start + length]


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(0, len(BLOB) - 1), length=st.integers(1, 3000))
def test_any_range_read_inside_the_blob_returns_its_bytes(backend, start, length):
    length = min(length, len(BLOB) - start)
    digest, _ = backend.registry.push_blob("contract/ranges", BLOB)
    assert backend.registry.read_blob_range("contract/ranges", digest, start, length) == BLOB[start:start + length]


def test_a_range_starting_past_the_end_is_refused(backend, repo):
    digest, _ = backend.registry.push_blob(repo, BLOB)
    with pytest.raises(RegistryError) as refused:
        backend.registry.read_blob_range(repo, digest, len(BLOB) + 10, 5)
    assert refused.value.status == 416


def test_a_manifest_is_found_by_tag_and_by_digest(backend, repo):
    body, digest = push_image_manifest(backend.registry, repo, "v1")
    assert digest == sha256_digest(body)
    assert backend.registry.get_manifest(repo, "v1") == (body, MANIFEST, digest)
    assert backend.registry.get_manifest(repo, digest) == (body, MANIFEST, digest)
    with pytest.raises(NotFound):
        backend.registry.get_manifest(repo, "v2")


def test_a_manifest_whose_blobs_were_not_pushed_is_refused(backend, repo):
    missing = sha256_digest(b"not pushed " + uuid.uuid4().bytes)
    body = canonical_json({"schemaVersion": 2, "mediaType": MANIFEST,
                           "config": {"mediaType": EMPTY, "digest": missing, "size": 2}, "layers": []})
    with pytest.raises(RegistryError) as refused:
        backend.registry.put_manifest(repo, "v1", body, MANIFEST)
    assert refused.value.status == 400


def artifact_referring_to(registry: Registry, repo: str, subject_body: bytes, subject_digest: str) -> str:
    empty_digest, empty_size = registry.push_blob(repo, EMPTY_JSON)
    body = canonical_json({"schemaVersion": 2, "mediaType": MANIFEST, "artifactType": "application/vnd.modelplane.test",
                           "config": {"mediaType": EMPTY, "digest": empty_digest, "size": empty_size},
                           "layers": [{"mediaType": EMPTY, "digest": empty_digest, "size": empty_size}],
                           "subject": {"mediaType": MANIFEST, "digest": subject_digest, "size": len(subject_body)}})
    return registry.put_manifest(repo, sha256_digest(body), body, MANIFEST)


def test_without_a_referrers_api_referrers_is_none(backend, repo):
    body, digest = push_image_manifest(backend.registry, repo, "v1")
    artifact_referring_to(backend.registry, repo, body, digest)  # docker-registry 2.8 stores it all the same
    assert backend.registry.referrers(repo, digest) is None


def test_the_fake_with_a_referrers_api_lists_the_manifests_with_that_subject():
    fake = FakeRegistry(referrers_api=True)
    body, digest = push_image_manifest(fake, "demo", "v1")
    assert fake.referrers("demo", digest) == []
    artifact = artifact_referring_to(fake, "demo", body, digest)
    found = fake.referrers("demo", digest)
    assert [(d.digest, d.artifact_type) for d in found] == [(artifact, "application/vnd.modelplane.test")]


def test_download_writes_the_blob_and_nothing_beside_it(backend, repo, tmp_path):
    digest, size = backend.registry.push_blob(repo, BLOB)
    assert backend.registry.download_blob(repo, digest, tmp_path / "blob") == size
    assert (tmp_path / "blob").read_bytes() == BLOB
    assert [path.name for path in tmp_path.iterdir()] == ["blob"]


def test_a_corrupted_blob_raises_and_leaves_no_file(backend, repo, tmp_path):
    content = BLOB + uuid.uuid4().bytes  # a blob of its own: tampering must not hurt other tests
    digest, _ = backend.registry.push_blob(repo, content)
    backend.tamper(digest)
    with pytest.raises(RegistryError, match="digest"):
        backend.registry.download_blob(repo, digest, tmp_path / "blob")
    with pytest.raises(RegistryError, match="digest"):
        backend.registry.get_blob(repo, digest)
    assert list(tmp_path.iterdir()) == []


# -- the HTTP adapter ---------------------------------------------------------------------

@pytest.mark.parametrize(("header", "expected"), [
    ('Basic realm="Registry Realm"', ("basic", {"realm": "Registry Realm"})),
    ('Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:a/b:pull"',
     ("bearer", {"realm": "https://auth.docker.io/token", "service": "registry.docker.io",
                 "scope": "repository:a/b:pull"})),
    ('Bearer realm="https://t/x", scope="repository:a:pull,push", error="insufficient_scope"',
     ("bearer", {"realm": "https://t/x", "scope": "repository:a:pull,push", "error": "insufficient_scope"})),
    ("Bearer realm=https://t/token,service=reg", ("bearer", {"realm": "https://t/token", "service": "reg"})),
])
def test_challenges_are_parsed_with_quoted_commas_and_bare_values(header, expected):
    assert parse_challenge(header) == expected


@pytest.mark.parametrize(("location", "expected"), [
    ("/v2/a/blobs/uploads/u1", "http://r:5000/v2/a/blobs/uploads/u1?digest=sha256%3Aab"),
    ("/v2/a/blobs/uploads/u1?_state=s", "http://r:5000/v2/a/blobs/uploads/u1?_state=s&digest=sha256%3Aab"),
    ("http://other:9/u1?x=1", "http://other:9/u1?x=1&digest=sha256%3Aab"),
])
def test_the_upload_url_adds_the_digest_to_absolute_and_relative_locations(location, expected):
    assert upload_url("http://r:5000", location, "sha256:ab") == expected


def test_a_blob_uploaded_from_a_file_is_streamed_not_read_into_memory(embedded_registry, tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as sparse:
        sparse.truncate(64 << 20)
    with HttpRegistry(embedded_registry.url) as registry:
        tracemalloc.start()
        try:
            digest, size = registry.push_blob("streaming/big", big)
            _, peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert registry.has_blob("streaming/big", digest)
    assert (digest, size) == (sha256_digest(bytes(64 << 20)), 64 << 20)
    assert peak_bytes < 16 << 20, f"uploading 64 MiB allocated {peak_bytes >> 20} MiB at peak"


def test_the_registry_reason_is_in_the_error(embedded_registry):
    body = canonical_json({"schemaVersion": 2, "mediaType": MANIFEST, "layers": [],
                           "config": {"mediaType": EMPTY, "digest": sha256_digest(b"nope"), "size": 4}})
    with HttpRegistry(embedded_registry.url) as registry, pytest.raises(RegistryError, match="MANIFEST_BLOB_UNKNOWN"):
        registry.put_manifest("errors/demo", "v1", body, MANIFEST)


def test_tags_lists_what_was_pushed(embedded_registry):
    with HttpRegistry(embedded_registry.url) as registry:
        for tag in ("v2", "v1"):
            push_image_manifest(registry, "tags/demo", tag)
        assert sorted(registry.tags("tags/demo")) == ["v1", "v2"]


# -- basic auth against the real registry, bearer auth against a token server --------------

@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory):
    skip_without_registry_binary()
    try:
        bcrypt_htpasswd_line("probe", "probe")
    except RuntimeError as exc:
        print(f"skipping basic auth: {exc}")
        pytest.skip(str(exc))
    with EmbeddedRegistry(tmp_path_factory.mktemp("auth-registry"), htpasswd=(USER, PASSWORD)) as registry:
        yield registry


def test_basic_auth_with_the_right_credentials_pushes_and_pulls(auth_registry):
    with HttpRegistry(auth_registry.url, username=USER, password=PASSWORD) as registry:
        digest, _ = registry.push_blob("auth/demo", BLOB)
        assert registry.read_blob_range("auth/demo", digest, 5, 10) == BLOB[5:15]


@pytest.mark.parametrize(("credentials", "message"), [({}, "needs credentials"),
                                                      ({"username": USER, "password": "wrong"}, "refused")])
def test_basic_auth_without_or_with_wrong_credentials_is_an_error_saying_so(auth_registry, credentials, message):
    with HttpRegistry(auth_registry.url, **credentials) as registry, pytest.raises(RegistryError, match=message) as err:
        registry.has_blob("auth/demo", sha256_digest(BLOB))
    assert err.value.status == 401


@pytest.mark.parametrize("token_registry", [{"token_key": "token"}, {"token_key": "access_token"}], indirect=True)
def test_bearer_tokens_are_fetched_with_credentials_and_cached_per_scope(token_registry):
    handler, url = token_registry
    with HttpRegistry(url, username=USER, password=PASSWORD) as registry:
        digest, _ = registry.push_blob("bearer/demo", BLOB)
        assert registry.get_blob("bearer/demo", digest) == BLOB
        assert registry.read_blob_range("bearer/demo", digest, 0, 4) == BLOB[:4]
    assert handler.blobs == {digest: BLOB}
    scopes = [query["scope"] for query, _ in handler.token_requests]
    assert scopes == ["repository:bearer/demo:pull", "repository:bearer/demo:pull,push"], "one token per scope"
    assert {query["service"] for query, _ in handler.token_requests} == {"test"}
    assert all(auth and auth.startswith("Basic ") for _, auth in handler.token_requests)


def test_a_token_endpoint_wanting_credentials_gives_an_error_saying_so(token_registry):
    _, url = token_registry
    with HttpRegistry(url) as registry, pytest.raises(RegistryError, match="needs credentials"):
        registry.has_blob("bearer/demo", sha256_digest(BLOB))


@pytest.mark.parametrize("token_registry", [{"require_credentials": False}], indirect=True)
def test_anonymous_bearer_tokens_need_no_credentials(token_registry):
    handler, url = token_registry
    handler.blobs[sha256_digest(BLOB)] = BLOB
    with HttpRegistry(url) as registry:
        assert registry.get_blob("bearer/demo", sha256_digest(BLOB)) == BLOB
    assert [auth for _, auth in handler.token_requests] == [None]


@pytest.mark.parametrize("token_registry", [{"require_credentials": False, "honour_range": False}], indirect=True)
def test_a_registry_ignoring_range_is_accepted_only_for_a_read_of_the_whole_blob(token_registry):
    handler, url = token_registry
    digest = sha256_digest(BLOB)
    handler.blobs[digest] = BLOB
    with HttpRegistry(url) as registry:
        assert registry.read_blob_range("bearer/demo", digest, 0, len(BLOB)) == BLOB
        for start, length in [(5, 10), (0, 10)]:
            with pytest.raises(RegistryError, match="ignored the Range header"):
                registry.read_blob_range("bearer/demo", digest, start, length)


# -- a registry that stops answering ------------------------------------------------------

@pytest.mark.parametrize("kind", ["closes", "hangs"])
def test_a_registry_that_stops_mid_download_gives_an_error_within_the_timeout(stalling_server, tmp_path, kind):
    url = stalling_server(kind)
    started = time.monotonic()
    with HttpRegistry(url, timeout_s=1.0) as registry, pytest.raises(RegistryError) as failed:
        registry.download_blob("stall/demo", sha256_digest(b"x"), tmp_path / "blob")
    assert time.monotonic() - started < 5.0
    assert failed.value.status == 0 and "127.0.0.1" in str(failed.value)
    assert list(tmp_path.iterdir()) == [], "no partial file is left behind"


def test_a_stopped_docker_registry_gives_an_error_within_the_timeout(tmp_path):
    skip_without_registry_binary()
    with EmbeddedRegistry(tmp_path / "registry") as embedded, HttpRegistry(embedded.url, timeout_s=1.0) as registry:
        digest, _ = registry.push_blob("stopped/demo", BLOB)
        os.kill(embedded.process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(RegistryError, match="Timeout"):
                registry.download_blob("stopped/demo", digest, tmp_path / "blob")
            assert time.monotonic() - started < 5.0
        finally:
            os.kill(embedded.process.pid, signal.SIGCONT)
    assert not (tmp_path / "blob").exists()


# -- the embedded registry ----------------------------------------------------------------

def test_the_embedded_registry_listens_on_loopback_only_and_keeps_data_under_its_root(embedded_registry):
    config = yaml.safe_load(embedded_registry.config_path.read_text())
    assert config["http"]["addr"] == f"127.0.0.1:{embedded_registry.port}"
    assert config["storage"]["filesystem"]["rootdirectory"] == str(embedded_registry.root / "data")
    assert config["storage"]["delete"] == {"enabled": True} and "health" not in config and "auth" not in config
    assert httpx.get(f"{embedded_registry.url}/v2/").status_code == 200


def test_a_missing_binary_is_an_error_saying_what_to_install(tmp_path):
    with pytest.raises(RuntimeError, match=re.escape("apt-get install docker-registry")):
        EmbeddedRegistry(tmp_path, binary=str(tmp_path / "no-such-binary")).start()


def test_a_registry_that_cannot_start_is_stopped_and_its_log_reported(tmp_path):
    skip_without_registry_binary()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        registry = EmbeddedRegistry(tmp_path, port=taken.getsockname()[1], startup_timeout_s=10.0)
        with pytest.raises(RuntimeError, match="address already in use"):
            registry.start()
    assert registry.process is None


def test_the_server_module_runs_in_the_foreground_until_sigterm(tmp_path):
    skip_without_registry_binary()
    port = free_port()
    command = [sys.executable, "-m", "images.oci.server", "--root", str(tmp_path), "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def answers() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1.0).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(answers, 20.0, "python -m images.oci.server to answer on /v2/")
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1.0)
    assert (tmp_path / "config.yml").exists() and (tmp_path / "registry.log").exists()
