"""The router's one error type: an HTTP status and a message a person can act on."""

from __future__ import annotations

from http import HTTPStatus

from starlette.responses import JSONResponse, PlainTextResponse, Response

# OpenAI's error types by status, as vLLM's server names them (and the openai SDK's exception
# classes, which the SDK picks by status); other statuses get their HTTP reason phrase.
OPENAI_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 409: "ConflictError", 422: "UnprocessableEntityError",
                429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
# MLflow's error codes by status (``mlflow.exceptions.ERROR_CODE_TO_HTTP_STATUS`` read backwards):
# what MLflow's clients read from a scoring server's error.
MLFLOW_CODES = {400: "BAD_REQUEST", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "ENDPOINT_NOT_FOUND",
                409: "RESOURCE_CONFLICT", 413: "BAD_REQUEST", 415: "BAD_REQUEST", 429: "REQUEST_LIMIT_EXCEEDED",
                499: "CANCELLED", 501: "NOT_IMPLEMENTED", 503: "TEMPORARILY_UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


class RouterError(Exception):
    """``param``: the request field at fault, where one is (OpenAI's ``error.param``)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error body, as vLLM's server writes it.

    >>> error_body(429, "slow down")
    {'error': {'message': 'slow down', 'type': 'RateLimitError', 'param': None, 'code': 429}}
    >>> error_body(413, "too big")["error"]["type"]
    'Request Entity Too Large'
    """
    kind = OPENAI_TYPES.get(status) or HTTPStatus(status).phrase
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def mlflow_error_code(status: int) -> str:
    """The MLflow error code a client maps back to ``status`` (a 4xx to a client error).

    >>> mlflow_error_code(429), mlflow_error_code(502)
    ('REQUEST_LIMIT_EXCEEDED', 'INTERNAL_ERROR')
    """
    return MLFLOW_CODES.get(status, "BAD_REQUEST" if 400 <= status < 500 else "INTERNAL_ERROR")


def error_response(exc: RouterError, mlflow: bool = False) -> Response:
    """The OpenAI error shape vLLM's server sends (``{"error": {"message", "type", "param",
    "code"}}``); on MLflow's ``/invocations`` route MLflow's ``error_code`` and ``message`` beside it,
    which MLflow's clients read, and a 415 in plain text, as MLflow's server answers it."""
    if mlflow and exc.status == 415:
        return PlainTextResponse(str(exc), status_code=415, headers=exc.headers)
    body = error_body(exc.status, str(exc), exc.param)
    if mlflow:
        body = {"error_code": mlflow_error_code(exc.status), "message": str(exc), **body}
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)
