"""Admission: who is calling, which endpoint, and what to send upstream (pure, no I/O).

Every refusal is a :class:`RouterError` with the HTTP status and a message a person can
act on; nothing here touches the network or the database.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from controlplane.tokens import Grant, token_sha256
from serving.media_types import JSON_TYPE
from serving.router.errors import RouterError
from serving.router.limits import RequestLimits, check_llm_fields, parse_json_object
from serving.router.table import EndpointRoute, RoutingTable

__all__ = ["RouterError", "Upstream", "authenticate", "authorize", "authorize_admin", "for_invocations", "for_openai",
           "openai_endpoint"]


@dataclass(frozen=True)
class Upstream:
    route: EndpointRoute
    path: str  # path on the replica, e.g. /invocations or /v1/chat/completions
    body: bytes
    stream: bool
    payload: dict | None = None  # the parsed body of an LLM request (for its cost)
    content_type: str = JSON_TYPE  # the body's media type, sent on to the replica
    # traceparent and tracestate for the replica (serving.router.tracing); {}: none
    trace_headers: dict[str, str] = field(default_factory=dict)


def token_key(authorization: str | None) -> str | None:
    """The sha256 of a well-formed bearer token (what the table holds), or None.

    >>> token_key("Bearer mp_x") == token_sha256("mp_x"), token_key("Basic abc"), token_key(None)
    (True, None, None)
    """
    scheme, _, token = (authorization or "").partition(" ")
    return token_sha256(token.strip()) if scheme.lower() == "bearer" and token.strip() else None


def authenticate(authorization: str | None, table: RoutingTable) -> Grant:
    if not authorization:
        raise RouterError(401, "missing Authorization header; send 'Authorization: Bearer <token>' "
                               "(create one with `modelplane tokens create --endpoint <name>`)",
                          {"WWW-Authenticate": "Bearer"})
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise RouterError(401, "Authorization must be 'Bearer <token>'", {"WWW-Authenticate": "Bearer"})
    grant = table.grants.get(token_sha256(token.strip()))
    if grant is None:
        raise RouterError(401, "unknown or revoked token", {"WWW-Authenticate": "Bearer"})
    return grant


def authorize(grant: Grant, endpoint: str, table: RoutingTable, retry_after_s: int) -> EndpointRoute:
    """The endpoint's route, for a token that may call it.

    A token that may not call an endpoint gets the same 403 whether or not the endpoint
    exists, so tokens cannot be used to list endpoints; only one allowed to call it (or an
    admin token) learns that it does not exist.
    """
    if not grant.allows(endpoint):
        raise RouterError(403, f"token {grant.token_id} may not call endpoint {endpoint!r}")
    route = table.endpoints.get(endpoint)
    if route is None:
        raise RouterError(404, f"no endpoint named {endpoint!r}")
    if route.revision_id is None:
        raise RouterError(503, f"endpoint {endpoint!r} has no ready replica: no revision is serving it yet; "
                               "retry shortly", {"Retry-After": str(retry_after_s)})
    return route  # with no ready replica yet, the activator holds the request (serving.router.activator)


def authorize_admin(grant: Grant, what: str) -> None:
    """The router's internal routes (``what``, e.g. ``/internal/in-flight``) answer admin tokens only."""
    if not grant.admin:
        raise RouterError(403, f"token {grant.token_id} needs the admin scope for {what} "
                               "(create one with `modelplane tokens create --admin`)")


def for_invocations(route: EndpointRoute, body: bytes, limits: RequestLimits,
                    content_type: str = JSON_TYPE) -> Upstream:
    """``/serving-endpoints/{name}/invocations``: MLflow scoring for classic models (a JSON, CSV
    or Parquet body, as MLflow's server reads them); for LLMs a chat (``messages``) or
    completion (``prompt``) request, in JSON."""
    if route.runtime == "pyfunc":
        if content_type == JSON_TYPE:
            parse_json_object(body, limits, allow_non_finite=True)  # NaN: pandas' missing value
        return Upstream(route, "/invocations", body, stream=False, content_type=content_type)
    _json_only(content_type, f"endpoint {route.name!r} serves an LLM")
    payload = parse_json_object(body, limits, allow_non_finite=False)
    if "messages" in payload:
        path = "/v1/chat/completions"
    elif "prompt" in payload:
        path = "/v1/completions"
    else:
        raise RouterError(400, f"endpoint {route.name!r} serves an LLM: send {{\"messages\": [...]}} (chat) "
                               "or {\"prompt\": \"...\"} (completion)")
    payload = check_llm_fields(payload, route.context_tokens, limits) | {"model": route.name}
    return Upstream(route, path, json.dumps(payload).encode(), stream=bool(payload.get("stream")), payload=payload)


def _json_only(content_type: str, why: str) -> None:
    if content_type != JSON_TYPE:
        raise RouterError(415, f"Content-Type {content_type!r} is not supported: {why}; send 'Content-Type: "
                               "application/json'")


def openai_endpoint(body: bytes, limits: RequestLimits, content_type: str = JSON_TYPE) -> tuple[str, dict]:
    """The endpoint an OpenAI-style request names in ``model``."""
    _json_only(content_type, "the OpenAI API takes JSON")
    payload = parse_json_object(body, limits, allow_non_finite=False)
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise RouterError(400, "'model' is required: the endpoint name, e.g. \"gec\"", param="model")
    return model, payload


def for_openai(route: EndpointRoute, path: str, payload: dict, body: bytes, limits: RequestLimits) -> Upstream:
    if route.runtime != "vllm":
        raise RouterError(400, f"endpoint {route.name!r} is not an LLM; call /serving-endpoints/{route.name}/invocations")
    checked = check_llm_fields(payload, route.context_tokens, limits)
    if len(checked) != len(payload):  # a field was stripped: send what was checked, not what came
        body = json.dumps(checked).encode()
    return Upstream(route, path, body, stream=bool(checked.get("stream")), payload=checked)
