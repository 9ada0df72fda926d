"""Verifying MLflow registry webhook deliveries (pure logic, no I/O).

MLflow (3.3+, ``mlflow/webhooks/delivery.py``) signs each delivery like Standard Webhooks:

    X-MLflow-Delivery-Id: <uuid>
    X-MLflow-Timestamp:   <unix seconds>
    X-MLflow-Signature:   v1,<base64(HMAC-SHA256(secret, "{delivery_id}.{timestamp}.{raw body}"))>

and the body is ``{"entity": ..., "action": ..., "timestamp": ..., "data": {...}}``.

Worked example: secret ``s3cret``, delivery ``d1``, timestamp ``1700000000``, body ``{}``
signs the bytes ``d1.1700000000.{}``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from dataclasses import dataclass

from controlplane.specs import MODEL_NAME

SIGNATURE_VERSION = "v1"
DEFAULT_TOLERANCE_S = 300.0
MAX_BODY_BYTES = 256 * 1024
MAX_MODEL_NAME_CHARS = 256
#: The registry events that can put a new version behind an alias.
EVENTS = ("model_version.created", "model_version_alias.created")


class WebhookRejected(Exception):
    """A delivery that must not be stored; ``str(exc)`` says why (for the 4xx body)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RegistryEvent:
    delivery_id: str
    event: str  # "<entity>.<action>", e.g. "model_version_alias.created"
    registered_model: str
    version: str | None
    alias: str | None
    raw_body: str


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """The ``X-MLflow-Signature`` header value MLflow sends for this delivery."""
    message = f"{delivery_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret.encode(), message, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def verify(
    *,
    secret: str,
    delivery_id: str | None,
    timestamp: str | None,
    signature: str | None,
    body: bytes,
    now_s: float,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> RegistryEvent:
    """Check headers, signature and freshness, then parse the body.

    Raises :class:`WebhookRejected` with status 401 for anything unauthenticated (missing
    headers, bad signature, a timestamp more than ``tolerance_s`` away from ``now_s``) and
    400 for a signed body that is not a registry event we understand.
    """
    if not delivery_id or not timestamp or not signature:
        raise WebhookRejected(
            401, "missing X-MLflow-Delivery-Id, X-MLflow-Timestamp or X-MLflow-Signature header"
        )
    if len(delivery_id) > 64:
        raise WebhookRejected(401, "X-MLflow-Delivery-Id is longer than 64 characters")
    try:
        sent_at_s = int(timestamp)
    except ValueError:
        raise WebhookRejected(401, "X-MLflow-Timestamp must be integer unix seconds") from None
    expected = sign(secret, delivery_id, timestamp, body)
    # Bytes, not str: compare_digest refuses non-ASCII str, and a header may carry any byte.
    expected_bytes = expected.encode()
    candidates = (c.strip().encode("utf-8", "replace") for c in signature.split(" "))
    if not any(hmac.compare_digest(expected_bytes, candidate) for candidate in candidates):
        raise WebhookRejected(401, "signature does not match the body (wrong secret or altered payload)")
    if abs(now_s - sent_at_s) > tolerance_s:
        raise WebhookRejected(
            401, f"timestamp {sent_at_s} is more than {tolerance_s:.0f} s from now; refusing a stale delivery"
        )
    return parse_event(delivery_id, body)


def parse_event(delivery_id: str, body: bytes) -> RegistryEvent:
    try:
        payload = json.loads(body)
        event = f"{payload['entity']}.{payload['action']}"
        data = payload["data"]
        name = data["name"]
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested past the parser's depth
        raise WebhookRejected(400, "body must be JSON with entity, action and data.name") from None
    if not isinstance(name, str) or len(name) > MAX_MODEL_NAME_CHARS or not re.fullmatch(MODEL_NAME, name):
        raise WebhookRejected(400, "data.name must be a registered model name modelplane can serve: letters, "
                                   "digits, '_', '.', '-', starting with a letter or digit, at most 256 characters")
    if not isinstance(data.get("alias"), (str, type(None))):
        raise WebhookRejected(400, "data.alias must be a string")
    version = data.get("version")
    return RegistryEvent(
        delivery_id=delivery_id,
        event=event,
        registered_model=name,
        version=None if version is None else str(version),
        alias=data.get("alias"),
        raw_body=body.decode("utf-8", errors="replace"),
    )
