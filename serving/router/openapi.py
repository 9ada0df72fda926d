"""The router's OpenAPI document, served at ``GET /openapi.json``.

Written by hand (the router is a Starlette app, not FastAPI) and kept to what the routes in
``serving.router.app`` accept; ``tests/test_api_schemas.py`` fuzzes the router from it.
"""

from __future__ import annotations

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}

_REFUSALS = {
    "400": "malformed request (the message names the field)",
    "401": "missing or unknown bearer token",
    "403": "the token does not grant this endpoint",
    "404": "no such endpoint",
    "413": "body larger than the router's limit",
    "415": "not application/json (a classic model's /invocations also takes text/csv and Parquet, and "
           "answers a 415 in plain text, as MLflow's server does)",
    "429": "rate limited (Retry-After)",
    "503": "no replica can take it now (Retry-After)",
}


def _answers(ok: dict) -> dict:
    return {"200": ok, **{code: {"description": why, "content": {"application/json": {"schema": ERROR}}}
                          for code, why in _REFUSALS.items()}}


_JSON_OK = {"description": "the replica's answer", "content": {"application/json": {"schema": {}}}}
_MESSAGE = {"type": "object", "required": ["role", "content"],
            "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant"]},
                           "content": {"type": "string"}}}
_SAMPLING = {"max_tokens": {"type": "integer", "minimum": 1}, "temperature": {"type": "number", "minimum": 0},
             "top_p": {"type": "number", "minimum": 0, "maximum": 1}, "stream": {"type": "boolean"}}
_CHAT = {"type": "object", "required": ["messages"],
         "properties": {"messages": {"type": "array", "minItems": 1, "items": _MESSAGE}, **_SAMPLING}}
_COMPLETION = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}, **_SAMPLING}}
_MLFLOW = {"oneOf": [
    {"type": "object", "required": ["dataframe_split"], "properties": {"dataframe_split": {
        "type": "object", "required": ["columns", "data"],
        "properties": {"columns": {"type": "array", "items": {"type": "string"}},
                       "data": {"type": "array", "items": {"type": "array"}}}}}},
    {"type": "object", "required": ["dataframe_records"],
     "properties": {"dataframe_records": {"type": "array", "items": {"type": "object"}}}},
    {"type": "object", "required": ["instances"], "properties": {"instances": {"type": "array"}}},
    {"type": "object", "required": ["inputs"], "properties": {"inputs": {}}},
]}


def _json_body(schema: dict) -> dict:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _with_model(schema: dict) -> dict:
    return {**schema, "required": [*schema["required"], "model"],
            "properties": {"model": {"type": "string", "description": "the endpoint name"}, **schema["properties"]}}


_ADMIN = [{"bearer": []}]

DOCUMENT = {
    "openapi": "3.1.0",
    "info": {"title": "modelplane router", "version": "0.1.0",
             "description": "Every endpoint's front door: MLflow scoring and the OpenAI API, behind bearer tokens."},
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    "security": [{"bearer": []}],
    "paths": {
        "/serving-endpoints/{name}/invocations": {"post": {
            "summary": "Score with an endpoint: MLflow's formats for classic models, chat or completion for LLMs.",
            "parameters": [{"name": "name", "in": "path", "required": True,
                            "schema": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"}}],
            "requestBody": _json_body({"oneOf": [_MLFLOW, _CHAT, _COMPLETION]}),
            "responses": _answers(_JSON_OK)}},
        "/v1/chat/completions": {"post": {"summary": "OpenAI chat completions; `model` is the endpoint.",
                                          "requestBody": _json_body(_with_model(_CHAT)),
                                          "responses": _answers(_JSON_OK)}},
        "/v1/completions": {"post": {"summary": "OpenAI completions; `model` is the endpoint.",
                                     "requestBody": _json_body(_with_model(_COMPLETION)),
                                     "responses": _answers(_JSON_OK)}},
        "/v1/models": {"get": {"summary": "The LLM endpoints this token may call.", "responses": _answers(_JSON_OK)}},
        "/healthz": {"get": {"summary": "The router is up.", "security": [], "responses": {"200": _JSON_OK}}},
        "/metrics": {"get": {"summary": "Prometheus metrics.", "security": [], "responses": {
            "200": {"description": "text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/internal/in-flight": {"get": {
            "summary": "Work in flight by second, for the autoscaler (admin tokens).", "security": _ADMIN,
            "parameters": [{"name": "since_s", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                           {"name": "replica_buckets", "in": "query", "schema": {"type": "boolean"}}],
            "responses": _answers(_JSON_OK)}},
        "/internal/replicas": {"get": {"summary": "Each endpoint's replicas as this router sees them (admin tokens).",
                                       "security": _ADMIN, "responses": _answers(_JSON_OK)}},
    },
}
