"""A userspace network link in front of a registry: bandwidth and a delay per request.

Every byte between the benchmark's clients and the registry crosses this proxy on
127.0.0.1. Down (registry → client) and up share nothing (a full-duplex link), and each
direction is one serial pipe of ``mbit_per_s``: a chunk leaves when the pipe has finished the
chunks before it, whatever connection they belong to — so parallel Range requests share the
bandwidth as they would on a real link. Each HTTP request waits ``request_latency_ms`` before
it is forwarded (the round trip a request costs on a real network); a request is the first
client bytes after the previous answer began on that connection.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    mbit_per_s: float
    request_latency_ms: float

    @property
    def bytes_per_s(self) -> float:
        return self.mbit_per_s * 1e6 / 8

    def label(self) -> str:
        return f"{self.mbit_per_s:g} Mbit/s, {self.request_latency_ms:g} ms/request"


class _Pipe:
    """One direction of the link: when each chunk may leave, given the ones before it."""

    def __init__(self, link: Link, clock=time.monotonic) -> None:
        self.link = link
        self._free_at = 0.0
        self._clock = clock

    def departure(self, size: int) -> float:
        """Seconds to wait before a chunk of ``size`` bytes has crossed the pipe.

        >>> pipe = _Pipe(Link(8, 0), clock=lambda: 0.0)  # 1 MB/s
        >>> pipe.departure(500_000), pipe.departure(500_000)
        (0.5, 1.0)
        """
        now = self._clock()
        self._free_at = max(now, self._free_at) + size / self.link.bytes_per_s
        return self._free_at - now


class ThrottlingProxy:
    """``with ThrottlingProxy("127.0.0.1", 5050, Link(200, 10)) as proxy: proxy.url``"""

    def __init__(self, upstream_host: str, upstream_port: int, link: Link, *, host: str = "127.0.0.1",
                 chunk_bytes: int = 64 << 10) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.host = host
        self.port = 0
        self.chunk_bytes = chunk_bytes
        self.requests = 0
        self.bytes_down = 0
        self.bytes_up = 0
        self._link = link
        self._down = _Pipe(link)
        self._up = _Pipe(link)
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="throttle-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def link(self) -> Link:
        return self._link

    def set_link(self, link: Link) -> None:
        """A new link for the next connections' bytes (between runs, not during one)."""
        self._link, self._down, self._up = link, _Pipe(link), _Pipe(link)

    def reset_counters(self) -> None:
        self.requests = self.bytes_down = self.bytes_up = 0

    def start(self) -> ThrottlingProxy:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._serve, self.host, 0), self._loop)
        self._server = future.result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            async def close() -> None:
                self._server.close()
                for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                    task.cancel()
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> ThrottlingProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        answered = asyncio.Event()
        answered.set()  # the connection's first bytes are a request
        up = asyncio.ensure_future(self._copy(client_reader, upstream_writer, up=True, answered=answered))
        down = asyncio.ensure_future(self._copy(upstream_reader, client_writer, up=False, answered=answered))
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        for task in (up, down):
            task.cancel()
        for writer in (client_writer, upstream_writer):
            writer.close()

    async def _copy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, up: bool,
                    answered: asyncio.Event) -> None:
        try:
            while chunk := await reader.read(self.chunk_bytes):
                if up and answered.is_set():  # a new request on this connection
                    answered.clear()
                    self.requests += 1
                    await asyncio.sleep(self._link.request_latency_ms / 1000)
                elif not up:
                    answered.set()
                pipe = self._up if up else self._down
                await asyncio.sleep(pipe.departure(len(chunk)))
                if up:
                    self.bytes_up += len(chunk)
                else:
                    self.bytes_down += len(chunk)
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            if not writer.is_closing():
                writer.close()
