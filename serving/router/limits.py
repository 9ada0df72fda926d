"""What a tenant may put in a request body, checked before anything is sent (pure, no I/O).

- **JSON itself**: nested at most ``max_json_depth`` levels (a body of 5,000 nested arrays is
  a 400, not a ``RecursionError``); in LLM requests no ``NaN`` or ``Infinity``, which
  Python's parser accepts and the engine would choke on. Classic-model bodies may carry
  ``NaN`` (pandas' missing values), so there it is left to the scoring server.
- **Fields tenants must not control** (LLM requests): ``priority`` is removed, because
  replicas run vLLM's priority scheduler and the liveness probe relies on jumping the queue;
  ``max_tokens`` / ``max_completion_tokens`` must be whole numbers from 1 to the serving
  model's context length; ``n`` and ``best_of`` at most :attr:`RequestLimits.max_choices`;
  ``logprobs`` (a count on ``/v1/completions``), ``top_logprobs`` and ``prompt_logprobs`` at
  most :attr:`RequestLimits.max_logprobs`. Each refusal names the field and the bound.

Worked example: ``{"model": "gec", "prompt": "x", "max_tokens": 10**9}`` against a model with
a 8,192-token context is refused with "max_tokens must be a whole number from 1 to 8192".

>>> check_llm_fields({"prompt": "x", "max_tokens": 16, "priority": -9}, 8192, RequestLimits())
{'prompt': 'x', 'max_tokens': 16}
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from serving.json_nesting import walk
from serving.media_types import JSON_TYPE, TABULAR_TYPES
from serving.router.errors import RouterError


@dataclass(frozen=True)
class RequestLimits:
    """Documented bounds on request bodies (docs/router.md lists them with their defaults)."""

    max_json_depth: int = 32  # containers inside containers; chat bodies need about 5
    max_choices: int = 8  # n and best_of
    max_logprobs: int = 20  # logprobs, top_logprobs, prompt_logprobs (OpenAI's own cap is 20)
    default_context_tokens: int = 32768  # when the serving revision does not say its context length


TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
CHOICE_FIELDS = ("n", "best_of")
LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")
STRIPPED_FIELDS = ("priority",)


class NonFinite(str):
    """What ``NaN``, ``Infinity`` and ``-Infinity`` parse to where they are not allowed."""


def check_content_type(value: str | None) -> str:
    """The body's media type: JSON (also when no header is sent, as a raw client may send
    none), or CSV or Parquet, which only a classic model's ``/invocations`` takes; a 415 for any
    other, or for a charset other than UTF-8.

    >>> check_content_type("application/json; charset=UTF-8"), check_content_type(None)
    ('application/json', 'application/json')
    >>> check_content_type("application/x-www-form-urlencoded")
    Traceback (most recent call last):
    serving.router.errors.RouterError: Content-Type 'application/x-www-form-urlencoded' is not supported: send 'Content-Type: application/json' (curl -d sends a form unless told otherwise)
    """
    if not value:
        return JSON_TYPE
    mime, *parameters = (part.strip() for part in value.split(";"))
    mime = mime.lower()
    charsets = [p.partition("=")[2].strip().strip('"').lower() for p in parameters
                if p.partition("=")[0].strip().lower() == "charset"]
    if mime not in (JSON_TYPE, *TABULAR_TYPES) or len(charsets) != len(parameters) or set(charsets) - {"utf-8", "utf8"}:
        raise RouterError(415, f"Content-Type {value!r} is not supported: send 'Content-Type: application/json' "
                               "(curl -d sends a form unless told otherwise)")
    return mime


def parse_json_object(body: bytes, limits: RequestLimits, allow_non_finite: bool) -> dict:
    """The body as a dict, or a 400 naming what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RouterError(400, f"body is not valid UTF-8 (byte {exc.start}): send JSON encoded as UTF-8") from None
    try:
        payload = json.loads(text) if allow_non_finite else json.loads(text, parse_constant=NonFinite)
    except RecursionError:
        raise RouterError(400, f"body is nested too deeply; at most {limits.max_json_depth} levels") from None
    except ValueError as exc:
        raise RouterError(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise RouterError(400, "body must be a JSON object")
    deepest, bad = scan(payload)
    if deepest > limits.max_json_depth:
        raise RouterError(400, f"body is nested too deeply; at most {limits.max_json_depth} levels")
    if bad is not None:
        where, value = bad
        raise RouterError(400, f"{where}: {value} is not a finite number; send a number", param=where)
    return payload


def scan(value) -> tuple[int, tuple[str, str] | None]:
    """(nesting depth, the first non-finite number's (path, token) or None).

    >>> scan({"a": [1, {"b": []}]})
    (4, None)
    >>> scan({"temperature": NonFinite("NaN")})
    (1, ('temperature', 'NaN'))
    """
    deepest, bad = 0, None
    for item, level, path in walk(value):
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
        elif isinstance(item, NonFinite) and bad is None:
            bad = (path or "(body)", str(item))
    return deepest, bad


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_llm_fields(payload: dict, context_tokens: int | None, limits: RequestLimits) -> dict:
    """``payload`` without the fields tenants must not set; a 400 for a field out of bounds."""
    context = context_tokens or limits.default_context_tokens
    for field in TOKEN_FIELDS:
        value = payload.get(field)
        if value is not None and not (_whole(value) and 1 <= value <= context):
            raise RouterError(400, f"{field} must be a whole number from 1 to {context} (the model's context "
                                   f"length), got {value!r}", param=field)
    for field in CHOICE_FIELDS:
        value = payload.get(field)
        if value is not None and not (_whole(value) and 1 <= value <= limits.max_choices):
            raise RouterError(400, f"'{field}' must be a whole number from 1 to {limits.max_choices}, got {value!r}",
                              param=field)
    for field in LOGPROB_FIELDS:
        value = payload.get(field)
        if value is None or isinstance(value, bool):  # chat's logprobs is a switch
            continue
        if not (_whole(value) and 0 <= value <= limits.max_logprobs):
            raise RouterError(400, f"{field} must be a whole number from 0 to {limits.max_logprobs}, got {value!r}",
                              param=field)
    return {key: value for key, value in payload.items() if key not in STRIPPED_FIELDS}
