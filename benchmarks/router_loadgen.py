"""The router benchmarks' open-loop load generator.

:func:`open_loop` sends pre-built request bytes over keep-alive connections opened before
the clock starts, at Poisson arrival times (seeded, so two runs at one rate get the same
arrivals), and times each request from the moment it is handed to a connection to its last
byte. :func:`run_loadgen` runs it in a process of its own
(``python -m benchmarks.router_loadgen SPEC_JSON``, pinned where asked), so it never shares
a loop, or a core's time slice, with the caller.

Connections to a port that several processes listen on with ``SO_REUSEPORT`` are each
given to one of them by the kernel: the generator spreads its connections over them without
knowing they are several.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import subprocess
import sys
import time

from benchmarks.router_bench_replica import REPO, content_length, http_request, pin


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
        length = content_length(bytes(self.buffer[:end])) or 0
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


def run_loadgen(spec: dict, cpus: list[int] | None, timeout_s: float = 300.0) -> dict:
    """:func:`open_loop` in a process of its own (pinned to ``cpus``), so it never shares the caller's loop.

    ``spec``: host, port, path, headers, rate_rps, duration_s, warmup_s, connections, seed and
    either ``body`` (one JSON string) or ``completions`` ({"model", "tokens": [[i, o], …]}).
    """
    done = subprocess.run([sys.executable, "-m", "benchmarks.router_loadgen", json.dumps(spec | {"cpus": cpus})],
                          cwd=REPO, capture_output=True, timeout=timeout_s)
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
    spec = json.loads(argv[0])
    pin(spec.get("cpus"))
    print(json.dumps(_loadgen(spec)))


if __name__ == "__main__":
    main(sys.argv[1:])
