"""The router benchmarks' server processes: replicas and the router under test.

``router_overhead`` and ``balance_quality`` start each with
``python -m benchmarks.router_bench_replica ROLE SPEC_JSON``:

- ``fast-replica``: answers ``POST /invocations`` with a fixed 20-byte JSON at once. It is
  a raw ``asyncio.Protocol`` on uvloop (HTTP/1.1 keep-alive, no framework), the cheapest
  thing that speaks HTTP here, so that what the router adds is not lost in the replica.
- ``llm-replicas``: several OpenAI-style ``/v1/completions`` servers in one process whose
  service time follows each request's token counts (:class:`TokenPacedReplica`).
- ``router``: the real router, ``serving.router.app.create_app`` with a static one-endpoint
  table and a real bearer token, started as ``serving.router.server.main`` starts it
  (``listening_sockets``, uvicorn with ``loop="uvloop"``, ``http="httptools"``,
  ``log_level="warning"``, ``settle_collector()`` before serving). Several may share one
  client port.

Each may be pinned to CPUs (``os.sched_setaffinity``). The load that drives them comes from
``benchmarks.router_loadgen``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from serving.runtime.process import free_port  # noqa: F401 - the benchmarks take ports from here

REPO = Path(__file__).resolve().parent.parent
FAST_ANSWER = b'{"predictions":[0]}'


def http_response(body: bytes, status: int = 200, content_type: bytes = b"application/json") -> bytes:
    reason = {200: b"OK", 404: b"Not Found", 400: b"Bad Request", 501: b"Not Implemented"}.get(status, b"Error")
    return (b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
            % (status, reason, content_type, len(body))) + body


def http_request(host: str, port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A whole ``POST`` request, built once and sent as is."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in (headers or {}).items()), f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def content_length(head: bytes) -> int | None:
    """The Content-Length of a header block; None for a chunked body (not spoken here)."""
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        return None
    at = lower.find(b"\r\ncontent-length:")
    if at < 0:
        return 0
    end = lower.find(b"\r\n", at + 2)
    return int(lower[at + 17:end if end >= 0 else len(lower)])


class HttpServer(asyncio.Protocol):
    """HTTP/1.1 keep-alive, one request at a time per connection, answers in order.

    ``handler(method, path, body)`` returns the whole response as bytes, or an awaitable of them.
    """

    def __init__(self, handler) -> None:
        self.handler = handler
        self.buffer = bytearray()
        self.busy = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self._serve_buffered()

    def _serve_buffered(self) -> None:
        while not self.transport.is_closing():
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end])
            length = content_length(head)
            if length is None:
                self.transport.write(http_response(b'{"error":"chunked bodies are not spoken here"}', 501))
                self.transport.close()
                return
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4:end + 4 + length])
            del self.buffer[:end + 4 + length]
            method, path = head.split(b" ", 2)[:2]
            answer = self.handler(method, path, body)
            if isinstance(answer, bytes):
                self.transport.write(answer)
                continue
            self.busy = True
            asyncio.ensure_future(answer).add_done_callback(self._answered)
            return

    def _answered(self, task: asyncio.Future) -> None:
        self.busy = False
        if self.transport.is_closing():
            return
        error = task.exception()
        self.transport.write(http_response(json.dumps({"error": repr(error)}).encode(), 500) if error
                             else task.result())
        self._serve_buffered()


def fast_handler(method: bytes, path: bytes, body: bytes) -> bytes:
    if path == b"/invocations" or path == b"/health":
        return FAST_ANSWER_RESPONSE
    return http_response(b'{"error":"not found"}', 404)


FAST_ANSWER_RESPONSE = http_response(FAST_ANSWER)


class FifoSlots:
    """``c`` service slots taken in arrival order (a request waits for a free slot)."""

    def __init__(self, slots: int) -> None:
        self.free = slots
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> None:
        if self.free and not self.waiters:
            self.free -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        await waiter

    def release(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the next in line
                return
        self.free += 1


@dataclass
class ServiceCost:
    """A replica's time for one request, in milliseconds: α·i + β·o + γ (the cost model's form).

    >>> ServiceCost(0.01, 0.5, 2.0, 4).service_ms(1000, 100)
    62.0
    """

    alpha_ms: float
    beta_ms: float
    gamma_ms: float
    slots: int

    def service_ms(self, input_tokens: float, output_tokens: float) -> float:
        return self.alpha_ms * input_tokens + self.beta_ms * output_tokens + self.gamma_ms


class TokenPacedReplica:
    """A fake LLM replica: ``slots`` requests served at once (a FIFO queue in front, no
    processor sharing), each holding its slot for ``slowdown × (α·i + β·o + γ)`` ms, with
    ``i`` the prompt's token ids and ``o`` its ``max_tokens`` (the answer is exactly ``o``
    tokens long, as with ``ignore_eos``). The time is an ``asyncio.sleep``: this models a
    GPU's time, it does not burn a CPU.
    """

    def __init__(self, name: str, cost: ServiceCost, slowdown: float = 1.0) -> None:
        self.name, self.cost, self.slowdown = name, cost, slowdown
        self.slots = FifoSlots(cost.slots)
        self.served = 0
        self.busy_ms = 0.0

    def handle(self, method: bytes, path: bytes, body: bytes):
        if path == b"/v1/completions":
            return self._complete(body)
        if path == b"/stats":
            return http_response(json.dumps({"name": self.name, "served": self.served,
                                             "busy_ms": round(self.busy_ms, 1)}).encode())
        if path == b"/health":
            return http_response(b'{"status":"ok"}')
        return http_response(b'{"error":"not found"}', 404)

    async def _complete(self, body: bytes) -> bytes:
        payload = json.loads(body)
        prompt = payload.get("prompt")
        input_tokens = len(prompt) if isinstance(prompt, list) else math.ceil(len(str(prompt or "")) / 4)
        output_tokens = int(payload.get("max_tokens") or 16)
        service_ms = self.slowdown * self.cost.service_ms(input_tokens, output_tokens)
        await self.slots.acquire()
        try:
            await asyncio.sleep(service_ms / 1000)
        finally:
            self.slots.release()
        self.served += 1
        self.busy_ms += service_ms
        answer = {"id": f"cmpl-{self.served}", "object": "text_completion", "model": payload.get("model"),
                  "replica": self.name,
                  "choices": [{"index": 0, "text": " x" * output_tokens, "finish_reason": "length"}],
                  "usage": {"prompt_tokens": input_tokens, "completion_tokens": output_tokens,
                            "total_tokens": input_tokens + output_tokens}}
        return http_response(json.dumps(answer).encode())


# ---- processes ------------------------------------------------------------------------------

def pin(cpus: list[int] | None) -> None:
    """Pin this process to ``cpus`` where all of them exist here (a 1-CPU box runs unpinned)."""
    if cpus and set(cpus) <= os.sched_getaffinity(0):
        os.sched_setaffinity(0, set(cpus))


def balancer_support() -> dict:
    """Whether the router in this checkout applies ``EndpointRoute.policy.balancer``."""
    try:
        from serving.router import balancing
        from serving.router.table import EndpointRoute
    except Exception as exc:  # noqa: BLE001 - a checkout mid-edit: report it, the router will not start either
        return {"route_has_policy": False, "balancers": [], "import_error": repr(exc)}
    return {"route_has_policy": "policy" in getattr(EndpointRoute, "__dataclass_fields__", {}),
            "balancers": sorted(getattr(balancing, "BALANCERS", {}) or [])}


def _serve_router(spec: dict) -> None:
    """The real router with a static one-endpoint table, started as ``serving.router.server.main``
    starts it: bound by ``listening_sockets`` (the client port ``spec["port"]`` with
    SO_REUSEPORT, so several routers may share it, plus a port of its own, written to
    ``spec["own_port_file"]`` when given), uvicorn on uvloop and httptools, and
    ``settle_collector()`` (gc.collect + gc.freeze) before serving unless ``spec["gc_freeze"]``
    is false (the ``--no-gc-freeze`` ablation)."""
    import uvicorn

    from controlplane.tokens import Grant, token_sha256
    from serving.router.app import create_app
    from serving.router.server import listening_sockets, settle_collector
    from serving.router.config import RouterConfig
    from serving.router.cost import RouteCost
    from serving.router.table import EndpointRoute, RoutingTable

    extra = {}
    if spec.get("balancer") and balancer_support()["route_has_policy"]:
        from serving.router.policy import RoutePolicy
        extra["policy"] = RoutePolicy(balancer=spec["balancer"])
    cost = RouteCost(*spec["cost"]) if spec.get("cost") else None
    route = EndpointRoute(name=spec["endpoint"], runtime=spec["runtime"], revision_id=f"{spec['endpoint']}-bench",
                          replicas=tuple(spec["replicas"]), cost=cost, **extra)
    table = RoutingTable(endpoints={route.name: route},
                         grants={token_sha256(spec["token"]): Grant("bench", frozenset({route.name}), False)})
    config = RouterConfig(host="127.0.0.1", port=spec["port"])
    app = create_app(config, lambda: table)
    shared, own = listening_sockets(config.host, config.port)
    if spec.get("own_port_file"):
        written = Path(spec["own_port_file"] + ".part")
        written.write_text(str(own.getsockname()[1]))
        written.rename(spec["own_port_file"])  # whole or absent: the parent never reads half a number
    server = uvicorn.Server(uvicorn.Config(app, loop="uvloop", http="httptools", log_level="warning"))
    if spec.get("gc_freeze", True):
        settle_collector()
    server.run(sockets=[shared, own])


def _serve(handlers: list, ports: list[int]) -> None:
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for handler, port in zip(handlers, ports):
            await loop.create_server(lambda h=handler: HttpServer(h), "127.0.0.1", port, backlog=4096)
        await asyncio.Event().wait()

    uvloop.run(main())


def start(role: str, spec: dict, log_path: Path) -> subprocess.Popen:
    """``python -m benchmarks.router_bench_replica ROLE SPEC`` in its own session (stop with :func:`stop`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "benchmarks.router_bench_replica", role, json.dumps(spec)],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    from serving.runtime.process import stop_server_session

    if process.poll() is None:
        stop_server_session(process, grace_s=5)


def wait_http(url: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until ``GET url`` answers 200 (or the process dies)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[3]} exited with {process.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def get_json(url: str) -> dict:
    return json.loads(get_text(url))


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def start_router(spec: dict, log_dir: Path, timeout_s: float = 60.0) -> tuple[subprocess.Popen, int]:
    """A ``router`` process on the client port ``spec["port"]`` (which other routers may share)
    and the port it listens on alone, once it answers ``/healthz`` there."""
    port_file = log_dir / f"router-{spec['port']}-{time.monotonic_ns()}.port"
    process = start("router", spec | {"own_port_file": str(port_file)}, log_dir / "router.log")
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            raise RuntimeError(f"the router did not bind within {timeout_s:.0f} s (exit {process.returncode}); "
                               f"see {log_dir / 'router.log'}")
        time.sleep(0.05)
    own_port = int(port_file.read_text())
    wait_http(f"http://127.0.0.1:{own_port}/healthz", process, timeout_s)
    return process, own_port



def main(argv: list[str]) -> None:
    role, spec = argv[0], json.loads(argv[1])
    pin(spec.get("cpus"))
    if role == "fast-replica":
        _serve([fast_handler], [spec["port"]])
    elif role == "llm-replicas":
        cost = ServiceCost(*spec["cost"])
        replicas = [TokenPacedReplica(f"replica-{port}", cost, spec.get("slowdown", {}).get(str(port), 1.0))
                    for port in spec["ports"]]
        _serve([r.handle for r in replicas], spec["ports"])
    elif role == "router":
        _serve_router(spec)
    else:
        raise SystemExit(f"unknown role {role!r}: fast-replica, llm-replicas or router")


if __name__ == "__main__":
    main(sys.argv[1:])
