"""Shared by the OCI tests: the embedded registry as a fixture, a sample tree, tree snapshots,
and two small servers: a bearer-token registry and one that stops answering mid-body.

Import a fixture into a test module (``from tests.oci_fixtures import embedded_registry``).
The embedded registry is module-scoped, listens on a free port of 127.0.0.1 and is stopped
after the module.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import socket
import stat
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from images.oci.registry import sha256_digest
from images.oci.server import EmbeddedRegistry, find_registry_binary

USER, PASSWORD = "modelplane", "s3cret pass"
BASIC_CREDENTIALS = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


def skip_without_registry_binary() -> None:
    if find_registry_binary() is None:
        pytest.skip("docker-registry is not installed (apt-get install docker-registry)")


@pytest.fixture(scope="module")
def embedded_registry(tmp_path_factory):
    skip_without_registry_binary()
    with EmbeddedRegistry(tmp_path_factory.mktemp("registry")) as registry:
        yield registry


def make_tree(root: Path) -> Path:
    """A small tree with what a model directory holds, and the awkward cases: modes, an
    empty file and directory, a symlink, a hard link, a non-ASCII name."""
    (root / "weights" / "shards").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    (root / "config.json").write_text('{"hidden_size": 64}\n')
    (root / "weights" / "shards" / "model-00001.safetensors").write_bytes(bytes(range(256)) * 1000)
    (root / "weights" / "shards" / "model-00002.safetensors").write_bytes(os.urandom(70_000))
    (root / "weights" / "empty").write_bytes(b"")
    (root / "run.sh").write_text("#!/bin/sh\nexec python -m serve\n")
    (root / "run.sh").chmod(0o755)
    (root / "private.key").write_text("not a real key\n")
    (root / "private.key").chmod(0o600)
    (root / "tokenizer-é.json").write_text("{}")
    (root / "latest").symlink_to("weights/shards/model-00001.safetensors")
    os.link(root / "config.json", root / "config-copy.json")
    return root


def snapshot(root: Path) -> dict[str, tuple]:
    """relative path → (kind, permission bits, content sha256 or link target)."""
    found: dict[str, tuple] = {}
    for directory, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(directory) / name
            info = os.lstat(path)
            relative = path.relative_to(root).as_posix()
            if stat.S_ISLNK(info.st_mode):
                found[relative] = ("link", None, os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                found[relative] = ("dir", stat.S_IMODE(info.st_mode), None)
            else:
                found[relative] = ("file", stat.S_IMODE(info.st_mode), hashlib.sha256(path.read_bytes()).hexdigest())
    return found


class TokenRegistry(BaseHTTPRequestHandler):
    """A registry that accepts only bearer tokens from its own /token endpoint.

    Blob GET/HEAD/upload only; uploads get a relative Location with a query, as some
    registries send. Class attributes are set per test by the ``token_registry`` fixture."""

    blobs: dict[str, bytes]
    token_requests: list[tuple[dict, str | None]]
    token_key = "token"
    require_credentials = True
    honour_range = True

    def log_message(self, *args) -> None:
        pass

    def reply(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def issue_token(self, query: dict) -> None:
        authorization = self.headers.get("Authorization")
        self.token_requests.append((query, authorization))
        if self.require_credentials and authorization != BASIC_CREDENTIALS:
            self.reply(401, b'{"errors":[{"code":"UNAUTHORIZED","message":"bad credentials"}]}')
            return
        self.reply(200, json.dumps({self.token_key: f"tok:{query.get('scope')}"}).encode())

    def handle_any(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        if url.path == "/token":
            return self.issue_token(query)
        match = re.fullmatch(r"/v2/(?P<repo>.+)/blobs/(?P<rest>.+)", url.path)
        if not match:
            return self.reply(404)
        scope = f"repository:{match['repo']}:{'pull' if self.command in ('GET', 'HEAD') else 'pull,push'}"
        if self.headers.get("Authorization") != f"Bearer tok:{scope}":
            realm = f"http://127.0.0.1:{self.server.server_address[1]}/token"
            challenge = f'Bearer realm="{realm}",service="test",scope="{scope}"'
            return self.reply(401, headers={"WWW-Authenticate": challenge})
        if self.command == "POST":
            return self.reply(202, headers={"Location": f"/v2/{match['repo']}/blobs/uploads/u1?_state=abc"})
        if self.command == "PUT":
            data = self.rfile.read(int(self.headers["Content-Length"]))
            assert query["_state"] == "abc" and query["digest"] == sha256_digest(data)
            self.blobs[query["digest"]] = data
            return self.reply(201, headers={"Docker-Content-Digest": query["digest"]})
        if match["rest"] not in self.blobs:
            return self.reply(404, b'{"errors":[{"code":"BLOB_UNKNOWN","message":"blob unknown"}]}')
        blob = self.blobs[match["rest"]]
        wanted = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        if wanted and self.honour_range:
            first, last = int(wanted[1]), min(int(wanted[2]), len(blob) - 1)
            return self.reply(206, blob[first:last + 1], {"Content-Range": f"bytes {first}-{last}/{len(blob)}"})
        self.reply(200, blob)

    do_GET = do_HEAD = do_POST = do_PUT = handle_any


@pytest.fixture
def token_registry(request):
    handler = type("Handler", (TokenRegistry,), {"blobs": {}, "token_requests": [], **getattr(request, "param", {})})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def stalling_server():
    """Answers one GET with headers promising 1 MB and 64 KiB of body, then closes the
    connection ("closes") or holds it open, sending nothing more ("hangs")."""
    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()
    behaviour: list[str] = []

    def serve() -> None:
        connection, _ = listener.accept()
        with connection:
            request = b""
            while b"\r\n\r\n" not in request:
                request += connection.recv(4096)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + bytes(65536))
            if behaviour[0] == "hangs":
                release.wait(30)

    def start(kind: str) -> str:
        behaviour.append(kind)
        threading.Thread(target=serve, daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    yield start
    release.set()
    listener.close()
