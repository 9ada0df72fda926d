"""An MLflow scoring request, from bytes to a value the batcher can use. Pure: no model, no I/O.

MLflow's protocol (``mlflow/pyfunc/scoring_server``): a JSON body is an object with exactly
one of ``dataframe_split``, ``dataframe_records``, ``instances`` or ``inputs``, plus an optional
``params`` object, other keys ignored as MLflow ignores them; or, for models that take chat,
completion or embedding requests, an object with ``messages``, ``prompt`` or ``input`` (MLflow's
"unified LLM input": the whole object is the model's input, and its answer is not wrapped in
``predictions``). JSON is read as Python's ``json`` reads it, so ``NaN``, ``Infinity`` and
``1e400`` are numbers, as in MLflow. A ``text/csv`` or ``application/vnd.apache.parquet`` body is
a DataFrame, read by MLflow's own parsers in :mod:`.predictor`. This module checks the envelope
(content type, JSON, one input key, a non-empty input) and, for the two dataframe formats, turns
the input into plain rows so that requests with the same columns and params can be concatenated
into one DataFrame. Everything about values and types is left to MLflow's own parsing and schema
enforcement in :mod:`.predictor`.

Example: ``{"dataframe_records": [{"a": 1, "b": 2}]}`` and
``{"dataframe_split": {"columns": ["a", "b"], "data": [[3, 4]]}}`` both become rows under the
columns ``("a", "b")`` and share a batch key, so one ``predict`` sees ``[[1, 2], [3, 4]]``.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import msgspec

from serving.json_nesting import depth
from serving.media_types import CSV_TYPE, JSON_TYPE, PARQUET_TYPE
from serving.runtime.pyfunc.responses import BAD_REQUEST, INVALID_PARAMETER_VALUE

DF_SPLIT = "dataframe_split"
DF_RECORDS = "dataframe_records"
INSTANCES = "instances"
INPUTS = "inputs"
INPUT_KEYS = (DF_SPLIT, DF_RECORDS, INSTANCES, INPUTS)
PARAMS_KEY = "params"
LLM_KEYS = ("messages", "prompt", "input")  # MLflow's SUPPORTED_LLM_FORMATS: chat, completions, embeddings
LLM_INPUT = "llm"  # Invocation.input_key of a unified LLM request: the whole object is the input
CSV, PARQUET = "csv", "parquet"  # Invocation.input_key of a CSV or Parquet body (the raw bytes)
BODY_FORMATS = {JSON_TYPE: "json", CSV_TYPE: CSV, PARQUET_TYPE: PARQUET}

_EXAMPLE = '{"dataframe_split": {"columns": ["x"], "data": [[1.0]]}}'
# Tensors of rank 30 and dataframes nest far less; a hostile body may nest 100,000 levels.
MAX_JSON_DEPTH = 32
_decoder = msgspec.json.Decoder()
_key_encoder = msgspec.json.Encoder(order="sorted")


class InvocationError(Exception):
    """A request the server answers without predicting: an HTTP status and a message to act on."""

    def __init__(self, status: int, message: str, error_code: str | None = None, *, plain_text: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code  # None: the status's usual code (responses.ERROR_CODES)
        self.plain_text = plain_text  # answered as text/plain, as MLflow answers a content type it refuses


@dataclass(frozen=True)
class FrameRows:
    """A dataframe input as rows under ``columns`` (None: the request named no columns)."""

    columns: tuple[str, ...] | None
    rows: list[list[Any]]


@dataclass(frozen=True)
class Invocation:
    """One parsed ``/invocations`` request."""

    input_key: str  # which of INPUT_KEYS the request used
    input_value: Any  # the JSON value under input_key, as MLflow's parser takes it
    params: dict[str, Any] | None
    row_count: int  # rows it adds to a batch (a batch is capped in rows)
    frame: FrameRows | None = None  # set for dataframe inputs that can be concatenated
    batch_key: Hashable | None = None  # equal keys may share one predict call; None = alone


def check_content_type(content_type: str | None) -> str:
    """The body's format ("json", "csv" or "parquet") for a content type MLflow's server reads,
    with at most a ``charset=utf-8`` parameter; else 415, in plain text as MLflow answers it.

    Unlike MLflow's server, which answers a request without a Content-Type with a 500, this is a
    415; and the type and charset are compared without regard to case (RFC 9110).

    >>> check_content_type("application/json; charset=UTF-8")
    'json'
    >>> check_content_type("text/csv")
    'csv'
    """
    if not content_type:
        raise InvocationError(415, "Content-Type is missing: send 'Content-Type: application/json'.", plain_text=True)
    mime, *parameters = (part.strip() for part in content_type.split(";"))
    for parameter in parameters:
        name, _, value = parameter.partition("=")
        if name.strip().lower() != "charset":
            raise InvocationError(415, f"Unrecognized content type parameters: {name.strip()}. Send "
                                       "'application/json' or 'application/json; charset=utf-8'.", plain_text=True)
        if value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise InvocationError(415, "The scoring server only supports UTF-8.", plain_text=True)
    body_format = BODY_FORMATS.get(mime.lower())
    if body_format is None:
        raise InvocationError(415, f"This predictor only supports the following content types: Types: "
                                   f"{list(BODY_FORMATS)}. Got {content_type!r}.", plain_text=True)
    return body_format


def parse_invocation(body: bytes, *, concatenate_frames: bool = True, body_format: str = "json") -> Invocation:
    """Parse a request body; raises :class:`InvocationError` (400) for a malformed envelope.

    ``concatenate_frames=False`` gives every request its own predict call (for models whose
    predict does not take a DataFrame, e.g. type-hinted PythonModels). ``body_format`` is what
    :func:`check_content_type` said: a CSV or Parquet body is kept as bytes for MLflow's parser.
    """
    if body_format in (CSV, PARQUET):
        if not body.strip():
            raise InvocationError(400, f"The {body_format.upper()} body is empty: send at least one row.")
        return Invocation(body_format, body, None, max(1, body.count(b"\n") - 1) if body_format == CSV else 1)
    document = _decode_json(body)
    if not isinstance(document, dict):
        raise InvocationError(400, f"The body must be a JSON object with exactly one of {', '.join(INPUT_KEYS)}; "
                                   f"got a JSON {type(document).__name__}. Example: {_EXAMPLE}.")
    if any(key in document for key in LLM_KEYS):  # MLflow looks for these first
        return Invocation(LLM_INPUT, document, None, 1)
    keys = [key for key in INPUT_KEYS if key in document]
    if len(keys) != 1:
        found = ", ".join(keys) if keys else f"none (keys were: {', '.join(map(str, document)) or 'none'})"
        raise InvocationError(400, f"The body must have exactly one of {', '.join(INPUT_KEYS)}; found {found}.")
    [key] = keys
    value = document[key]
    params = document.get(PARAMS_KEY)
    if params is not None and not isinstance(params, dict):
        raise InvocationError(400, f"'params' must be a JSON object of parameter name to value; "
                                   f"got a {type(params).__name__}.", INVALID_PARAMETER_VALUE)

    frame = _frame_rows(key, value)
    row_count = len(frame.rows) if frame else _row_count(key, value)
    if row_count == 0:
        raise InvocationError(400, f"'{key}' holds no rows: send at least one.")
    batch_key = None
    if frame is not None and concatenate_frames:
        batch_key = ("frame", frame.columns, _key_encoder.encode(params) if params else b"")
    return Invocation(key, value, params, row_count, frame, batch_key)


def _decode_json(body: bytes) -> Any:
    """The JSON document, as Python's ``json`` (MLflow's reader) reads it; 400 if it is not one.

    msgspec reads it first (fast); what msgspec refuses that ``json`` accepts (``NaN``,
    ``Infinity``, ``-Infinity``, a number too large for a float) is read by ``json``.

    >>> _decode_json(b'[NaN, -Infinity, 1e400]')
    [nan, -inf, inf]
    """
    too_deep = InvocationError(400, f"The body is nested more than {MAX_JSON_DEPTH} levels deep; no MLflow input "
                                    "format needs that.")
    try:
        document = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        try:
            document = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise InvocationError(400, f"The body is not valid UTF-8 JSON ({exc}). Send a JSON object such as "
                                       f"{_EXAMPLE}.", BAD_REQUEST) from None
        except RecursionError:
            raise too_deep from None
    except RecursionError:
        raise too_deep from None
    if depth(document) > MAX_JSON_DEPTH:
        raise too_deep
    return document


def _frame_rows(key: str, value: Any) -> FrameRows | None:
    """Rows of a dataframe input, or None when it must be parsed on its own (only MLflow's parser
    sees it then, which also produces the error for a malformed one)."""
    if key == DF_SPLIT:
        if not isinstance(value, dict):
            raise InvocationError(400, f"'{DF_SPLIT}' must be an object with 'data' and optional 'columns' "
                                       f"and 'index'; got a {type(value).__name__}. Example: {_EXAMPLE}.")
        if "data" not in value or set(value) - {"columns", "data", "index"}:
            raise InvocationError(400, f"'{DF_SPLIT}' must have 'data' and optionally 'columns' and 'index'; "
                                       f"got keys {sorted(value)}.")
        columns, data = value.get("columns"), value["data"]
        if "index" in value or not isinstance(data, list):
            return None  # an index or a non-list 'data' is kept exactly as MLflow reads it
        if columns is None:
            width = len(data[0]) if data and isinstance(data[0], list) else -1
            if all(isinstance(row, list) and len(row) == width for row in data):
                return FrameRows(None, data)
            return None
        if not (isinstance(columns, list) and all(isinstance(c, str) for c in columns)):
            return None
        if all(isinstance(row, list) and len(row) == len(columns) for row in data):
            return FrameRows(tuple(columns), data)
        return None
    if key == DF_RECORDS:
        if not isinstance(value, list):
            raise InvocationError(400, f"'{DF_RECORDS}' must be a list of records (JSON objects of column to "
                                       f"value); got a {type(value).__name__}.")
        if not value or not all(isinstance(record, dict) for record in value):
            return None
        columns = tuple(value[0])
        names = set(columns)
        if not all(len(record) == len(columns) and record.keys() == names for record in value):
            return None  # records with different columns: pandas fills gaps, MLflow's parser decides
        return FrameRows(columns, [[record[c] for c in columns] for record in value])
    return None


def _row_count(key: str, value: Any) -> int:
    """Rows in an input that is not concatenated (tensor formats, indexed frames): its length."""
    if key == DF_SPLIT:
        data = value["data"]
        return len(data) if isinstance(data, list) else 1
    if isinstance(value, list):
        return len(value)
    if isinstance(value, dict) and value:
        first = next(iter(value.values()))
        return len(first) if isinstance(first, list) else 1
    return 1
