"""Replicas a previous supervisor left running: adopted when they are healthy, stopped otherwise.

A supervisor that crashed (or was restarted by ``modelplane up``) left its replica processes
running, each in a session of its own, serving the router. Killing and restarting them would
interrupt every endpoint for a model load; so a new supervisor takes over each replica whose
row says ready, whose process is still the one that row names (its pid, with the row's port
on its command line) and whose revision still wants it, once its ``/health`` answers. The
rest are stopped and forgotten, as before.
"""

from __future__ import annotations

import subprocess

import httpx
import psutil

from serving.tls import tls_context


class AdoptedProcess:
    """A replica process this supervisor did not start, behind the Popen calls the supervisor makes."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._process = psutil.Process(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                if self._process.status() == psutil.STATUS_ZOMBIE:
                    self.returncode = -1
            except psutil.NoSuchProcess:
                self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        try:
            code = self._process.wait(timeout)
        except psutil.TimeoutExpired:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout) from None
        except psutil.NoSuchProcess:
            code = None
        self.returncode = -1 if code is None else code
        return self.returncode


def replica_process(pid: int | None, port: int) -> bool:
    """True when ``pid`` is alive and is the replica serving ``port`` (not a reused pid): the port
    is on its command line (a cold start), or it listens on it (a replica the warm pool forked
    from a zygote keeps the zygote's command line)."""
    if not pid:
        return False
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return str(port) in process.cmdline() or any(
            c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in process.net_connections(kind="inet"))
    except (psutil.Error, ProcessLookupError):
        return False


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s, verify=tls_context()).status_code == 200
    except httpx.HTTPError:
        return False
