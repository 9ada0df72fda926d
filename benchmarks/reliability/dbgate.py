"""A TCP gate in front of PostgreSQL that can make the database unreachable and bring it back.

    gate = DbGate("127.0.0.1", 5432)
    port = gate.start()                    # listens on 127.0.0.1:<port>, forwards both ways
    engine = make_engine(gate.url(database_url))
    gate.cut()                             # the database is unreachable ...
    gate.restore()                         # ... and back, on the same port
    gate.close()
    gate.connections_cut                   # connections reset by cut(), for the report

What "unreachable" models: a database server that went away (crashed, restarted, failed
over) or a connection refused on its way there. While cut, every connection that was open
is reset (RST: SO_LINGER 0, then close), so a client blocked on a read fails at once and
PostgreSQL rolls back whatever transaction that connection held; and a new connection is
refused (nothing listens on the port). Both are what a client sees when the server process
or its host is gone and the host (or a load balancer) still answers at the TCP level.

What it does not model: a silent partition (packets dropped, nothing answered). There a
client learns nothing until one of its own timeouts fires, so such a test measures the
timeouts (``connect_timeout``, TCP keepalives, ``tcp_user_timeout``: ``controlplane.db``)
rather than the behaviour of the platform with the database gone; a fault that answers
fast tells whether each component keeps serving, answers 503 or drops and counts, and a
run takes seconds, not minutes. A refused connection is also the common case in practice:
a restarted or failed-over PostgreSQL refuses until it listens again.

The port stays reserved while cut: the listening socket is closed and the port is held by a
bound socket that does not listen (a connection to it is refused), which :meth:`restore`
then turns into the listener again, so no other program can take the port meanwhile.

Everything runs on an asyncio loop in a background thread; the methods may be called from
any thread and return once the gate is in the state they name.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from dataclasses import dataclass

LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST instead of FIN


def _reset(sock) -> None:
    """Close ``sock`` (a socket, or an asyncio transport's) with a RST."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
    except OSError:
        pass  # already closed by the peer: nothing to reset


def _bound(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock


@dataclass(eq=False)
class _Link:
    """One client connection and, once it is connected, its upstream connection."""

    client: socket.socket
    client_writer: asyncio.StreamWriter | None = None
    upstream_writer: asyncio.StreamWriter | None = None
    handed_over: bool = False  # the client socket belongs to an asyncio transport (being) made for it
    cut: bool = False

    def abort(self, reset: bool) -> None:
        writers = [w for w in (self.client_writer, self.upstream_writer) if w is not None]
        if not self.handed_over:  # the raw socket is still ours to close
            if reset:
                _reset(self.client)
            self.client.close()
        for writer in writers:
            if reset:
                _reset(writer.get_extra_info("socket"))
            writer.transport.abort()


class DbGate:
    """Forwards ``host:port`` (a free port unless given) to ``upstream_host:upstream_port``."""

    def __init__(self, upstream_host: str, upstream_port: int, *, host: str = "127.0.0.1", port: int = 0,
                 connect_timeout_s: float = 5.0, chunk_bytes: int = 64 << 10, backlog: int = 128) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.host, self.port = host, port
        self.connect_timeout_s, self.chunk_bytes, self.backlog = connect_timeout_s, chunk_bytes, backlog
        self.connections_cut = 0  # client connections reset by cut(), over every cut
        self.connections_accepted = 0
        self._links: set[_Link] = set()
        self._tasks: set[asyncio.Task] = set()  # one per client connection, until it ends
        self._socket: socket.socket | None = None  # listening, or (while cut) bound and not listening
        self._listening = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- the API, callable from any thread -------------------------------------------------
    def start(self) -> int:
        """Start listening and forwarding; returns the port."""
        if self._loop is not None:
            raise RuntimeError("the gate is already started")
        self._socket = _bound(self.host, self.port)
        self.port = self._socket.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"dbgate-{self.port}", daemon=True)
        self._thread.start()
        self._call(self._listen)
        return self.port

    def cut(self) -> int:
        """Make the database unreachable: reset every open connection, refuse new ones until
        :meth:`restore`. Returns how many connections this cut reset."""
        return self._call(self._cut)

    def restore(self) -> None:
        """Listen again on the same port and forward new connections (the cut ones stay gone)."""
        self._call(self._listen)

    def close(self) -> None:
        """Stop: close the listener and every connection (a plain close, not a reset)."""
        if self._loop is None:
            return
        self._call(self._close)
        self._call(self._settle)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self._loop = self._thread = None

    @property
    def is_cut(self) -> bool:
        return self._loop is not None and not self._listening

    @property
    def open_connections(self) -> int:
        return len(self._links)

    def url(self, database_url: str) -> str:
        """``database_url`` pointed at this gate instead of the server (same user, database, options)."""
        from sqlalchemy.engine import make_url

        return make_url(database_url).set(host=self.host, port=self.port).render_as_string(hide_password=False)

    def __enter__(self) -> "DbGate":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- on the loop's thread ---------------------------------------------------------------
    def _call(self, action):
        async def run():
            result = action()
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    async def _settle(self) -> None:
        """Let the connections' tasks see their sockets closed and end (none is left pending)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        for task in self._tasks:
            task.cancel()

    def _listen(self) -> None:
        if self._listening:
            return
        self._socket.listen(self.backlog)
        self._loop.add_reader(self._socket.fileno(), self._accept)
        self._listening = True

    def _cut(self) -> int:
        if self._listening:
            # Hold the port with a bound socket that does not listen: a connection is refused.
            self._loop.remove_reader(self._socket.fileno())
            self._socket.close()
            self._socket = _bound(self.host, self.port)
            self._listening = False
        links, self._links = list(self._links), set()
        for link in links:
            link.cut = True
            link.abort(reset=True)
        self.connections_cut += len(links)
        return len(links)

    def _close(self) -> None:
        if self._listening:
            self._loop.remove_reader(self._socket.fileno())
        self._socket.close()
        self._listening = False
        links, self._links = list(self._links), set()
        for link in links:
            link.cut = True
            link.abort(reset=False)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. the peer reset before accept; nothing to forward
            client.setblocking(False)
            self.connections_accepted += 1
            link = _Link(client)
            self._links.add(link)
            task = self._loop.create_task(self._serve(link))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, link: _Link) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream), self.connect_timeout_s)
        except (OSError, TimeoutError):
            if not link.cut:  # the server is really down: the client sees a reset, as it would
                self._links.discard(link)
                link.abort(reset=True)
            return
        link.upstream_writer = upstream_writer
        if link.cut:  # cut while connecting upstream (the client socket is closed already)
            link.abort(reset=True)
            return
        link.handed_over = True
        client_reader, client_writer = await asyncio.open_connection(sock=link.client)
        link.client_writer = client_writer
        if link.cut:  # cut while the client's transport was made
            link.abort(reset=True)
            return
        try:
            await asyncio.gather(self._pump(client_reader, upstream_writer, link),
                                 self._pump(upstream_reader, client_writer, link))
        finally:
            if link in self._links:
                self._links.discard(link)
                for writer in (client_writer, upstream_writer):
                    writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link) -> None:
        """Copy one direction until EOF (passed on as a half-close); an error ends both directions."""
        try:
            while data := await reader.read(self.chunk_bytes):
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof() and not writer.is_closing():
                writer.write_eof()
        except OSError:
            if link in self._links:  # not one of ours being cut: pass the failure on
                self._links.discard(link)
                link.abort(reset=True)
