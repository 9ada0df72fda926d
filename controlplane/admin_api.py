"""The admin API: health, the MLflow webhook receiver, read access to endpoint specs, and
each endpoint's canary and shadow traffic (``GET``/``PUT /endpoints/{name}/traffic``).

Routes are thin: they read the request, call :class:`WebhookReceiver` or a store, and map
the result (or a :class:`~controlplane.webhooks.WebhookRejected`) to a response. Run it with
``python -m controlplane.admin_api`` (``modelplane up`` does).

Who may call what: ``/healthz`` anyone; ``/webhooks/mlflow`` whoever signs the delivery with
the webhook secret (MLflow sends no bearer token); every other route a bearer token with the
``admin`` scope (``modelplane tokens create --admin``): 401 without a known token, 403 for a
token without the scope.

While the control-plane database cannot be reached, every route answers 503 with a
``Retry-After`` and says so (:func:`database_unavailable`), ``/healthz`` included: it tells a
load balancer not to send traffic here. ``modelplane up`` reads ``/healthz`` only while it
starts the services and restarts a service only when its process exits, so a 503 from a live
admin API never gets it restarted. Every write is one transaction: a request answered 503
changed nothing, unless its commit reached the database before the connection broke (then it
happened whole).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.concurrency import run_in_threadpool

from controlplane.splits import Share, SplitError, SplitStore
from controlplane.store import EndpointStore, WebhookInbox
from controlplane.tokens import TokenStore
from controlplane.webhooks import EVENTS, MAX_BODY_BYTES, WebhookRejected, verify


@dataclass
class WebhookReceiver:
    """Verify a delivery, then store it once in the inbox; never store a rejected one."""

    secret: str
    inbox: WebhookInbox
    now_s: Callable[[], float] = time.time
    tolerance_s: float = 300.0

    def receive(self, headers: dict[str, str | None], body: bytes) -> dict:
        event = verify(
            secret=self.secret,
            delivery_id=headers.get("x-mlflow-delivery-id"),
            timestamp=headers.get("x-mlflow-timestamp"),
            signature=headers.get("x-mlflow-signature"),
            body=body,
            now_s=self.now_s(),
            tolerance_s=self.tolerance_s,
        )
        if self.inbox.contains(event.delivery_id):
            raise WebhookRejected(401, f"delivery {event.delivery_id} was already received; refusing a replay")
        if event.event not in EVENTS:
            return {"status": "ignored", "event": event.event, "reason": f"modelplane acts on {', '.join(EVENTS)}"}
        if not self.inbox.add(event.delivery_id, event.event, event.registered_model, event.raw_body):
            raise WebhookRejected(401, f"delivery {event.delivery_id} was already received; refusing a replay")
        return {"status": "accepted", "event": event.event, "model": event.registered_model}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": message}, headers=headers)


DATABASE_RETRY_AFTER_S = 5


def database_unavailable(exc: Exception) -> str | None:
    """What to tell a caller when ``exc`` means the database cannot serve requests now
    (unreachable, connection lost, locked, no pooled connection free); None for any other
    error, which is a bug and stays a 500.

    >>> refused = OperationalError("SELECT 1", {}, ConnectionRefusedError("Connection refused\\n  Is the server …"))
    >>> database_unavailable(refused)[:87]
    'the control-plane database is unreachable (ConnectionRefusedError: Connection refused);'
    >>> database_unavailable(DBAPIError("INSERT …", {}, ValueError("bad value"))) is None
    True
    """
    if isinstance(exc, PoolTimeout):
        detail = "every pooled connection is busy"
    elif isinstance(exc, (OperationalError, InterfaceError)) or getattr(exc, "connection_invalidated", False):
        orig = getattr(exc, "orig", None) or exc
        detail = f"{type(orig).__name__}: {(str(orig).splitlines() or [''])[0][:200]}"
    else:
        return None
    return (f"the control-plane database is unreachable ({detail}); retry in a few seconds, and if it lasts, "
            "check the database that MODELPLANE_DATABASE_URL names")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise WebhookRejected(413, f"body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise WebhookRejected(413, f"body is larger than the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def admin_grant(tokens: TokenStore, authorization: str | None) -> None:
    """Raise :class:`WebhookRejected` (401/403) unless ``authorization`` carries a token with the admin scope."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise WebhookRejected(401, "send 'Authorization: Bearer <admin token>' "
                                   "(create one with `modelplane tokens create --admin`)")
    grant = tokens.verify(token.strip())
    if grant is None:
        raise WebhookRejected(401, "unknown or revoked token")
    if not grant.admin:
        raise WebhookRejected(403, f"token {grant.token_id} needs the admin scope for the admin API")


def create_app(engine: Engine, receiver: WebhookReceiver, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="modelplane admin API", version="0.1.0")
    endpoints = EndpointStore(engine)
    tokens = TokenStore(engine)

    def require_admin(request: Request) -> None:
        admin_grant(tokens, request.headers.get("authorization"))

    @app.exception_handler(WebhookRejected)
    async def _rejected(_request: Request, exc: WebhookRejected) -> JSONResponse:
        return _error(exc.status, str(exc))

    @app.exception_handler(DBAPIError)
    @app.exception_handler(PoolTimeout)
    async def _database_down(_request: Request, exc: Exception) -> JSONResponse:
        message = database_unavailable(exc)
        if message is None:
            raise exc
        return _error(503, message, {"Retry-After": str(DATABASE_RETRY_AFTER_S)})

    @app.get("/healthz")
    def healthz() -> dict:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        return {"status": "ok"}

    @app.post("/webhooks/mlflow")
    async def mlflow_webhook(request: Request) -> dict:
        body = await _read_body(request, max_body_bytes)
        return await run_in_threadpool(receiver.receive, dict(request.headers), body)  # off the event loop

    @app.get("/endpoints", dependencies=[Depends(require_admin)])
    def list_endpoints() -> list[dict]:
        return [spec.model_dump(mode="json") for spec in endpoints.list()]

    @app.get("/endpoints/{name}", dependencies=[Depends(require_admin)])
    def show_endpoint(name: str):
        spec = endpoints.get(name)
        if spec is None:
            return _error(404, f"no endpoint named {name!r}; `modelplane endpoints list` shows what exists")
        return spec.model_dump(mode="json")

    splits = SplitStore(engine)

    @app.get("/endpoints/{name}/traffic", dependencies=[Depends(require_admin)])
    def show_traffic(name: str):
        current = splits.get(name)
        if current is None:
            return _error(404, f"endpoint {name!r} serves no revision (or does not exist)")
        return current.to_json()

    @app.put("/endpoints/{name}/traffic", dependencies=[Depends(require_admin)])
    async def set_traffic(name: str, request: Request):
        """Body: ``{"canary": {"revision": id, "percent": 10} | null, "shadow": {…} | null}``;
        null clears that split, a missing key leaves it as it is."""
        try:
            body = json.loads(await _read_body(request, 16 * 1024))
            if not isinstance(body, dict) or not body or set(body) - {"canary", "shadow"}:
                raise ValueError("send a JSON object with 'canary' and/or 'shadow'")
            shares = {key: _share(key, value) for key, value in body.items()}
            return (await run_in_threadpool(splits.set, name, **shares)).to_json()  # off the event loop
        except SplitError as exc:
            return _error(exc.status, str(exc))
        except ValueError as exc:
            return _error(400, str(exc))

    return app


def _share(key: str, value) -> Share | None:
    if value is None:
        return None
    if not (isinstance(value, dict) and set(value) == {"revision", "percent"} and isinstance(value["revision"], str)
            and isinstance(value["percent"], (int, float)) and not isinstance(value["percent"], bool)):
        raise ValueError(f"{key} must be {{\"revision\": \"<revision id>\", \"percent\": <number>}} or null")
    try:
        percent = float(value["percent"])
    except OverflowError:
        raise ValueError(f"{key} percent is not a number from 0 to 100") from None
    return Share(value["revision"], percent)


def main() -> None:
    import uvicorn

    from controlplane.db import make_engine
    from controlplane.settings import Settings

    settings = Settings.from_env()
    engine = make_engine(settings.database_url)
    receiver = WebhookReceiver(secret=settings.secrets().webhook_secret, inbox=WebhookInbox(engine))
    uvicorn.run(create_app(engine, receiver), host=settings.host, port=settings.ports.admin_port, log_level="warning")


if __name__ == "__main__":
    main()
