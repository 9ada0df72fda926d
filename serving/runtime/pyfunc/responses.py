"""HTTP answers as values: a status and a body, errors in MLflow's shape. No MLflow import.

Statuses and error codes are those of MLflow's scoring server (``mlflow models serve``): every
error a request causes is a 400 whose ``error_code`` is ``BAD_REQUEST`` or
``INVALID_PARAMETER_VALUE`` (MLflow's ``MlflowException.get_http_status_code`` maps both to 400),
and content types it does not read are a 415 in plain text. What this server adds (413 for an
oversized body, 503 while loading) carries the code MLflow's client would map back to a
client error or to "retry later".
"""

from __future__ import annotations

import msgspec

MAX_MESSAGE_CHARS = 2000
BAD_REQUEST = "BAD_REQUEST"
INVALID_PARAMETER_VALUE = "INVALID_PARAMETER_VALUE"
# The code for each status when the error names none. 413: MLflow's server has no body limit,
# and its REQUEST_LIMIT_EXCEEDED means 429 to MLflow's client, so an oversized body is a
# BAD_REQUEST (400 to that client: the request, not the rate, is at fault).
ERROR_CODES = {400: BAD_REQUEST, 404: "ENDPOINT_NOT_FOUND", 405: BAD_REQUEST, 413: BAD_REQUEST,
               415: BAD_REQUEST, 500: "INTERNAL_ERROR", 503: "TEMPORARILY_UNAVAILABLE"}

_encoder = msgspec.json.Encoder()


class Outcome(msgspec.Struct, frozen=True):
    """An HTTP answer: status, body and its content type; ``model_fault``: the model raised on
    input that passed its signature (:mod:`serving.blame`)."""

    status: int
    body: bytes
    content_type: bytes = b"application/json"
    model_fault: bool = False


def error_outcome(status: int, message: str, error_code: str | None = None, model_fault: bool = False) -> Outcome:
    """MLflow's error shape, ``{"error_code": ..., "message": ...}``, the message capped in length.

    >>> error_outcome(413, "too big").body
    b'{"error_code":"BAD_REQUEST","message":"too big"}'
    >>> error_outcome(400, "no such column", INVALID_PARAMETER_VALUE).body
    b'{"error_code":"INVALID_PARAMETER_VALUE","message":"no such column"}'
    """
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "… (truncated)"
    return Outcome(status, _encoder.encode({"error_code": error_code or ERROR_CODES.get(status, "INTERNAL_ERROR"),
                                            "message": message}), model_fault=model_fault)


def text_outcome(status: int, message: str) -> Outcome:
    """A plain-text answer, as MLflow's server gives for a content type it does not read (415).

    >>> text_outcome(415, "only JSON").content_type
    b'text/plain; charset=utf-8'
    """
    return Outcome(status, message.encode(), b"text/plain; charset=utf-8")
