"""HTTP answers as values: a status and a JSON body, errors in MLflow's shape. No MLflow import."""

from __future__ import annotations

import msgspec

MAX_MESSAGE_CHARS = 2000
ERROR_CODES = {400: "BAD_REQUEST", 404: "ENDPOINT_NOT_FOUND", 405: "BAD_REQUEST", 413: "REQUEST_LIMIT_EXCEEDED",
               415: "BAD_REQUEST", 422: "INVALID_PARAMETER_VALUE", 500: "INTERNAL_ERROR",
               503: "TEMPORARILY_UNAVAILABLE"}

_encoder = msgspec.json.Encoder()


class Outcome(msgspec.Struct, frozen=True):
    """An HTTP answer: status and JSON body."""

    status: int
    body: bytes


def error_outcome(status: int, message: str) -> Outcome:
    """MLflow's error shape, ``{"error_code": ..., "message": ...}``, the message capped in length.

    >>> error_outcome(413, "too big").body
    b'{"error_code":"REQUEST_LIMIT_EXCEEDED","message":"too big"}'
    """
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "… (truncated)"
    return Outcome(status, _encoder.encode({"error_code": ERROR_CODES.get(status, "INTERNAL_ERROR"),
                                            "message": message}))
