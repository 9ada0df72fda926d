"""The embedded registry: the CNCF distribution registry (``docker-registry``) on 127.0.0.1.

``modelplane up`` and the tests need a real OCI registry without Docker. Debian packages
distribution 2.8 as ``docker-registry``; this module writes its config and runs it as a
child process. The package's own ``/etc/docker/registry/config.yml`` listens on every
interface and is never used: the config written here binds ``host`` (127.0.0.1 by default)
and keeps all data under ``root``.

Run it in the foreground with ``python -m images.oci.server --root DIR --port N``; with
``--user NAME`` it asks for basic auth, the password read from $MODELPLANE_REGISTRY_PASSWORD
(never from the command line, where ``ps`` would show it).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

PACKAGED_BINARY = "/usr/bin/docker-registry"
INSTALL_HINT = "install the Debian package docker-registry (apt-get install docker-registry)"
PASSWORD_ENV = "MODELPLANE_REGISTRY_PASSWORD"


def find_registry_binary() -> str | None:
    found = shutil.which("docker-registry")
    if found:
        return found
    return PACKAGED_BINARY if os.access(PACKAGED_BINARY, os.X_OK) else None


def registry_config(root: Path, host: str, port: int, htpasswd_path: Path | None) -> dict:
    """The distribution config: filesystem storage under ``root/data``, deletes allowed,
    ``host:port`` only, warnings only, no health checks (nothing to probe but the disk)."""
    config: dict = {
        "version": 0.1,
        # No access log: the lazy fetcher makes a range request per sector read, and a log
        # line per request would grow without bound on a long-lived registry.
        "log": {"level": "warn", "accesslog": {"disabled": True}, "fields": {"service": "modelplane-registry"}},
        "storage": {"filesystem": {"rootdirectory": str(root / "data")}, "delete": {"enabled": True}},
        # The secret signs upload state; one registry process needs no shared value, but
        # without one distribution warns on every start.
        "http": {"addr": f"{_bracketed(host)}:{port}", "secret": secrets.token_hex(16),
                 "headers": {"X-Content-Type-Options": ["nosniff"]}},
    }
    if htpasswd_path is not None:
        config["auth"] = {"htpasswd": {"realm": "modelplane", "path": str(htpasswd_path)}}
    return config


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def bcrypt_htpasswd_line(user: str, password: str) -> str:
    """``user:$2...`` for an htpasswd file (distribution accepts bcrypt only).

    Uses the ``bcrypt`` module when installed, else ``htpasswd`` from apache2-utils (the
    password goes on its stdin, not its command line). RuntimeError when neither is there.
    """
    try:
        import bcrypt  # type: ignore[import-not-found]
    except ImportError:
        bcrypt = None
    if bcrypt is not None:
        return f"{user}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt()).decode()}"
    tool = shutil.which("htpasswd")
    if tool is None:
        raise RuntimeError("basic auth needs bcrypt hashes: install the Python package bcrypt, "
                           "or the Debian package apache2-utils (apt-get install apache2-utils)")
    result = subprocess.run([tool, "-niB", user], input=password + "\n", capture_output=True, text=True, check=True)
    return result.stdout.strip()


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EmbeddedRegistry:
    """A ``docker-registry serve`` child process with its config and data under ``root``."""

    def __init__(self, root: Path, *, host: str = "127.0.0.1", port: int = 0,
                 htpasswd: tuple[str, str] | None = None, binary: str | None = None,
                 startup_timeout_s: float = 30.0, stop_grace_s: float = 5.0) -> None:
        self.root = Path(root)
        self.host = host
        self.port = port
        self.htpasswd = htpasswd
        self.binary = binary
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.process: subprocess.Popen | None = None
        self._pick_port = port == 0

    @property
    def url(self) -> str:
        return f"http://{_bracketed(self.host)}:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.root / "config.yml"

    @property
    def log_path(self) -> Path:
        return self.root / "registry.log"

    def blob_data_path(self, digest: str) -> Path:
        """Where distribution's filesystem driver keeps a blob's bytes (for inspection)."""
        hexpart = digest.removeprefix("sha256:")
        return self.root / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexpart[:2] / hexpart / "data"

    def write_config(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        htpasswd_path = None
        if self.htpasswd is not None:
            htpasswd_path = self.root / "htpasswd"
            htpasswd_path.write_text(bcrypt_htpasswd_line(*self.htpasswd) + "\n")
            htpasswd_path.chmod(0o600)
        config = registry_config(self.root, self.host, self.port, htpasswd_path)
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.config_path.chmod(0o600)
        return self.config_path

    def start(self) -> EmbeddedRegistry:
        """Start the registry and wait until ``GET /v2/`` answers; RuntimeError (with the end
        of its log) when it does not within ``startup_timeout_s``."""
        if self.process is not None and self.process.poll() is None:
            return self
        binary = self.binary or find_registry_binary()
        if binary is None or not os.access(binary, os.X_OK):
            raise RuntimeError(f"no docker-registry binary at {binary or 'PATH'}: {INSTALL_HINT}")
        # A port picked here can be taken before the registry binds it; try another then.
        for attempt in range(3 if self._pick_port else 1):
            if self._pick_port:
                self.port = _free_port(self.host)
            self.write_config()
            # REGISTRY_* variables override the config file; none may leak in from outside.
            env = {key: value for key, value in os.environ.items() if not key.startswith("REGISTRY_")}
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen([binary, "serve", str(self.config_path)], stdin=subprocess.DEVNULL,
                                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            if self._wait_until_answering():
                return self
            self.stop()
            if "address already in use" not in self.log_tail():
                break
        raise RuntimeError(f"docker-registry did not answer on {self.url}/v2/ within {self.startup_timeout_s:.0f} s; "
                           f"the end of {self.log_path}:\n{self.log_tail()}")

    def _wait_until_answering(self) -> bool:
        ready = {200, 401} if self.htpasswd else {200}
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.url}/v2/", timeout=1.0).status_code in ready:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        return False

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_grace_s``; waits for the process either way."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(self.stop_grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> EmbeddedRegistry:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """Run the registry in the foreground until SIGTERM or SIGINT (or until it dies)."""
    parser = argparse.ArgumentParser(prog="python -m images.oci.server", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="directory for config.yml, registry.log and data/")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000, help="0 picks a free one")
    parser.add_argument("--user", help=f"require basic auth as this user; password from ${PASSWORD_ENV}")
    args = parser.parse_args(argv)
    htpasswd = None
    if args.user:
        if not os.environ.get(PASSWORD_ENV):
            parser.error(f"--user needs the password in ${PASSWORD_ENV}")
        htpasswd = (args.user, os.environ[PASSWORD_ENV])
    stop_requested = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop_requested.set())
    registry = EmbeddedRegistry(args.root, host=args.host, port=args.port, htpasswd=htpasswd)
    try:
        registry.start()
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"registry on {registry.url} (data in {args.root / 'data'}, log {registry.log_path})", flush=True)
    try:
        while not stop_requested.wait(0.5):
            if registry.process is None or registry.process.poll() is not None:
                print(f"docker-registry exited; the end of its log:\n{registry.log_tail()}", file=sys.stderr)
                return 1
    finally:
        registry.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
