"""The router benchmarks' processes: replicas, the router under test, and an open-loop load generator.

``router_overhead`` and ``balance_quality`` each run three kinds of process, all started
with ``python -m benchmarks.router_bench_replica ROLE SPEC_JSON``:

- ``fast-replica``: answers ``POST /invocations`` with a fixed 20-byte JSON at once. It is
  a raw ``asyncio.Protocol`` on uvloop (HTTP/1.1 keep-alive, no framework), the cheapest
  thing that speaks HTTP here, so that what the router adds is not lost in the replica.
- ``llm-replicas``: several OpenAI-style ``/v1/completions`` servers in one process whose
  service time follows each request's token counts (:class:`TokenPacedReplica`).
- ``router``: the real router, ``serving.router.app.create_app`` with a static one-endpoint
  table and a real bearer token, run by uvicorn with ``loop="uvloop"``, ``http="httptools"``
  and ``log_level="warning"``, as ``serving.router.app.main`` runs it.

Each may be pinned to CPUs (``os.sched_setaffinity``). The load generator
(:func:`open_loop`, role ``loadgen``) sends pre-built request bytes over keep-alive
connections opened before the clock starts, at Poisson arrival times, and times each
request from the moment it is handed to a connection to its last byte.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import random
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


def _content_length(head: bytes) -> int | None:
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
            length = _content_length(head)
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


# ---- the open-loop load generator ----------------------------------------------------------

class _Client(asyncio.Protocol):
    """One keep-alive connection of the generator: one request at a time, answers parsed by Content-Length."""

    def __init__(self, on_answer, on_lost) -> None:
        self.on_answer, self.on_lost = on_answer, on_lost
        self.buffer = bytearray()
        self.transport = None
        self.request: tuple[int, float] | None = None  # (request number, handed-over time)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, number: int, data: bytes) -> None:
        self.request = (number, time.perf_counter())
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        length = _content_length(bytes(self.buffer[:end])) or 0
        if len(self.buffer) < end + 4 + length:
            return
        status = int(self.buffer[9:12])
        del self.buffer[:end + 4 + length]
        request, self.request = self.request, None
        self.on_answer(self, request, status, time.perf_counter())

    def connection_lost(self, exc) -> None:
        self.on_lost(self, self.request)


def poisson_offsets(rate_rps: float, span_s: float, seed: int) -> list[float]:
    """Arrival times in [0, span_s) of a Poisson process of ``rate_rps`` (seeded: both sides get the same)."""
    rng, offsets, t = random.Random(seed), [], 0.0
    while True:
        t += rng.expovariate(rate_rps)
        if t >= span_s:
            return offsets
        offsets.append(t)


def nearest_rank_ms(latencies_s: list[float], q: float) -> float:
    """Nearest-rank percentile in ms (``benchmarks.loadgen``'s definition).

    >>> nearest_rank_ms([i / 1000 for i in range(1, 201)], 0.99)
    198.0
    """
    if not latencies_s:
        return float("nan")
    ordered = sorted(latencies_s)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))] * 1000


async def open_loop(host: str, port: int, requests: list[bytes], *, rate_rps: float, duration_s: float,
                    warmup_s: float = 1.0, connections: int = 256, seed: int = 0,
                    drain_timeout_s: float = 30.0, keep_samples: bool = False) -> dict:
    """Send ``requests`` (cycled, in order) at Poisson arrivals of ``rate_rps`` for
    ``warmup_s + duration_s``; figures cover the requests due in the last ``duration_s``.

    A request's latency runs from when the generator hands it to an idle connection (or, when
    none is idle, from when it was due and found none: waiting for a connection is the
    server's backlog, so it counts) to its last byte. ``lateness`` is how far behind its
    arrival time the generator got round to a request: the generator's own slack.
    ``keep_samples`` adds every measured request as [due offset s, latency ms] (for diagnosis).
    """
    loop = asyncio.get_running_loop()
    offsets = poisson_offsets(rate_rps, warmup_s + duration_s, seed)
    idle: collections.deque[_Client] = collections.deque()
    waiting: collections.deque[tuple[int, float]] = collections.deque()
    ready_at: dict[int, float] = {}
    latencies: dict[int, float] = {}
    done_at: dict[int, float] = {}
    statuses: collections.Counter = collections.Counter()
    state = {"errors": 0, "waited": 0, "outstanding": 0, "lost": 0}
    drained = loop.create_future()

    def finish_one() -> None:
        state["outstanding"] -= 1
        if state["outstanding"] == 0 and state.get("all_sent") and not drained.done():
            drained.set_result(None)

    def hand_over(client: _Client) -> None:
        if waiting:
            number, _due = waiting.popleft()
            client.send(number, requests[number % len(requests)])
        else:
            idle.append(client)

    def on_answer(client, request, status, now) -> None:
        number, _sent = request
        latencies[number], done_at[number] = now - ready_at[number], now
        statuses[status] += 1
        if status >= 400:
            state["errors"] += 1
        finish_one()
        hand_over(client)

    def on_lost(client, request) -> None:
        if state.get("closing"):
            return
        state["lost"] += 1
        with_request = request is not None
        if client in idle:
            idle.remove(client)
        if with_request:
            state["errors"] += 1
            statuses["connection lost"] += 1
            finish_one()
        loop.create_task(reconnect())

    async def connect() -> _Client:
        _transport, client = await loop.create_connection(lambda: _Client(on_answer, on_lost), host, port)
        return client

    async def reconnect() -> None:
        try:
            hand_over(await connect())
        except OSError:
            state["errors"] += 1

    for client in await asyncio.gather(*(connect() for _ in range(connections))):
        idle.append(client)
    lateness: list[float] = []
    start = time.perf_counter() + 0.05
    for number, offset in enumerate(offsets):
        due = start + offset
        now = time.perf_counter()
        if due > now:
            await asyncio.sleep(due - now)
            now = time.perf_counter()
        lateness.append(now - due)
        ready_at[number] = now
        state["outstanding"] += 1
        if idle:
            idle.popleft().send(number, requests[number % len(requests)])
        else:
            state["waited"] += 1
            waiting.append((number, now))
    state["all_sent"] = True
    if state["outstanding"]:
        try:
            await asyncio.wait_for(asyncio.shield(drained), drain_timeout_s)
        except asyncio.TimeoutError:
            pass
    state["closing"] = True
    for client in list(idle):
        client.transport.close()

    measured = [n for n, offset in enumerate(offsets) if offset >= warmup_s]
    answered = [n for n in measured if n in latencies]
    values = [latencies[n] for n in answered]
    # answers per second over the measured requests' answers: equals the offered rate when the
    # server keeps up, falls below it when answers pile up behind
    first, last = min((done_at[n] for n in answered), default=0.0), max((done_at[n] for n in answered), default=0.0)
    sent_first, sent_last = (ready_at[measured[0]], ready_at[measured[-1]]) if measured else (0.0, 0.0)
    result = {"rate_rps": rate_rps, "duration_s": duration_s, "connections": connections,
            "sent": len(measured), "answered": len(answered), "errors": state["errors"],
            "unanswered": len(measured) - len(answered), "statuses": {str(k): v for k, v in statuses.items()},
            "achieved_rps": round((len(answered) - 1) / (last - first), 1) if last > first else 0.0,
            "offered_rps": round((len(measured) - 1) / (sent_last - sent_first), 1) if sent_last > sent_first else 0.0,
            "p50_ms": round(nearest_rank_ms(values, 0.50), 3), "p90_ms": round(nearest_rank_ms(values, 0.90), 3),
            "p99_ms": round(nearest_rank_ms(values, 0.99), 3), "max_ms": round(max(values, default=0) * 1000, 3),
            "lateness_p50_ms": round(nearest_rank_ms(lateness, 0.50), 3),
            "lateness_p99_ms": round(nearest_rank_ms(lateness, 0.99), 3),
            "waited_for_connection": state["waited"], "connections_lost": state["lost"]}
    if keep_samples:
        result["samples_ms"] = [[round(offsets[n], 4), round(latencies[n] * 1000, 3)] for n in answered]
    return result


def completion_bodies(model: str, tokens: list[tuple[int, int]]) -> list[bytes]:
    """``{"model", "prompt": [token ids], "max_tokens": o}`` for each (i, o): the router counts ids exactly."""
    return [json.dumps({"model": model, "prompt": [1] * i, "max_tokens": o}, separators=(",", ":")).encode()
            for i, o in tokens]


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
    import uvicorn

    from controlplane.tokens import Grant, token_sha256
    from serving.router.app import create_app
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
    app = create_app(RouterConfig(port=spec["port"]), lambda: table)
    if spec.get("gc_freeze"):
        # An ablation, not how serving.router.app.main runs: move everything alive after
        # start-up out of the collector's sight, so a full collection no longer walks the
        # imported modules' objects (about 47 ms per full collection here, all requests waiting).
        import gc
        gc.collect()
        gc.freeze()
    uvicorn.run(app, host="127.0.0.1", port=spec["port"], log_level="warning", loop="uvloop", http="httptools")


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
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def run_loadgen(spec: dict, cpus: list[int] | None, timeout_s: float = 300.0) -> dict:
    """:func:`open_loop` in a process of its own (pinned to ``cpus``), so it never shares the caller's loop.

    ``spec``: host, port, path, headers, rate_rps, duration_s, warmup_s, connections, seed and
    either ``body`` (one JSON string) or ``completions`` ({"model", "tokens": [[i, o], …]}).
    """
    done = subprocess.run([sys.executable, "-m", "benchmarks.router_bench_replica", "loadgen",
                           json.dumps(spec | {"cpus": cpus})], cwd=REPO, capture_output=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed: {done.stderr.decode()[-2000:]}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def _loadgen(spec: dict) -> dict:
    import uvloop

    if "completions" in spec:
        bodies = completion_bodies(spec["completions"]["model"], [tuple(t) for t in spec["completions"]["tokens"]])
    else:
        bodies = [spec["body"].encode()]
    requests = [http_request(spec["host"], spec["port"], spec["path"], body, spec.get("headers")) for body in bodies]
    return uvloop.run(open_loop(spec["host"], spec["port"], requests, rate_rps=spec["rate_rps"],
                                duration_s=spec["duration_s"], warmup_s=spec.get("warmup_s", 1.0),
                                connections=spec.get("connections", 256), seed=spec.get("seed", 0),
                                keep_samples=spec.get("keep_samples", False)))


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
    elif role == "loadgen":
        print(json.dumps(_loadgen(spec)))
    else:
        raise SystemExit(f"unknown role {role!r}: fast-replica, llm-replicas, router or loadgen")


if __name__ == "__main__":
    main(sys.argv[1:])
