"""Fake replica servers for router tests: real HTTP on loopback, canned model behaviour.

They speak the engine APIs the router forwards to (MLflow ``/invocations``, OpenAI
``/v1/completions`` and ``/v1/chat/completions`` with SSE streaming), so the router's
proxying, retries and streaming are exercised over real sockets.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

from aiohttp import web
from multidict import CIMultiDict


class FakeReplica:
    def __init__(self, name: str, behaviour: str = "ok") -> None:
        self.name = name
        # "ok" | "close" (drop the connection after reading the request, before answering) |
        # "stall" (read the request, never answer) | "huge" (answer with a body of ``huge_bytes``) |
        # "cut" (stream two chunks, then drop the connection) | "error" (answer 500 with a JSON body) |
        # "die" (read the first request, stop listening and drop the connection: a process killed mid-request)
        self.behaviour = behaviour
        self.huge_bytes = 4 << 20
        self.requests: list[tuple[str, dict]] = []
        self.headers: list[CIMultiDict] = []  # each request's headers as the replica received them
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._stopping: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FakeReplica":
        self._thread.start()
        self._started.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stopping.set)  # stalled handlers give up
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stopping = asyncio.Event()
        app = web.Application()
        app.router.add_post("/invocations", self._invocations)
        app.router.add_post("/v1/chat/completions", self._openai)
        app.router.add_post("/v1/completions", self._openai)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        """The pyfunc runtime's progress counters: what a drain or a liveness look reads."""
        from serving.runtime.pyfunc.metrics import COMPLETED, IN_FLIGHT, QUEUE_DEPTH

        return web.Response(text=f"{COMPLETED}_total {len(self.requests)}\n{IN_FLIGHT} 0\n{QUEUE_DEPTH} 0\n")

    async def _maybe_close(self, request: web.Request) -> None:
        if self.behaviour in ("close", "stall", "die"):
            self.requests.append((request.path, await request.json()))  # it reached the replica
        if self.behaviour == "die":
            for site in self._runner.sites:
                site._server.close()  # the port refuses from now on, as a dead process's does
            request.transport.close()
            raise ConnectionResetError("died before answering")
        if self.behaviour == "close":
            request.transport.close()
            raise ConnectionResetError("closed before answering")
        if self.behaviour == "stall":
            await self._stopping.wait()
            raise ConnectionResetError("stopped while stalling")

    async def _invocations(self, request: web.Request) -> web.StreamResponse:
        self.headers.append(CIMultiDict(request.headers))
        await self._maybe_close(request)
        if request.content_type == "text/csv":  # a CSV body: its rows after the header, as MLflow's parser reads it
            text = await request.text()
            self.requests.append(("/invocations", text))
            return web.json_response({"predictions": [self.name] * (len(text.strip().splitlines()) - 1)})
        payload = await request.json()
        self.requests.append(("/invocations", payload))
        split = payload.get("dataframe_split") if isinstance(payload, dict) else None
        rows = split.get("data") if isinstance(split, dict) else []
        if not isinstance(rows, list):  # as the real scoring server: a 400 that says why, not a crash
            return web.json_response({"error_code": "BAD_REQUEST", "message": "dataframe_split.data must be a list"},
                                     status=400)
        return web.json_response({"predictions": [self.name] * len(rows)})

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        self.headers.append(CIMultiDict(request.headers))
        await self._maybe_close(request)
        payload = await request.json()
        self.requests.append((request.path, payload))
        if self.behaviour == "error":
            return web.json_response({"object": "error", "message": "engine failed", "code": 500}, status=500)
        if self.behaviour == "huge":
            return web.Response(body=b"x" * self.huge_bytes, content_type="application/json")
        if self.behaviour == "cut":
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"data: {}\n\n")
            request.transport.close()
            return response
        if not payload.get("stream"):
            return web.json_response({"object": "chat.completion", "model": payload["model"], "replica": self.name,
                                      "choices": [{"message": {"role": "assistant", "content": "She goes."}}],
                                      "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in ["She", " goes", "."]:
            chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": word}}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response
