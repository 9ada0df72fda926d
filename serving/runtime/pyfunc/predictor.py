"""The MLflow model behind the server: parse with MLflow, enforce the signature, predict, encode.

:meth:`PyfuncPredictor.predict_batch` runs in the worker thread. Dataframe requests that share a
batch key (one request or many) become one DataFrame, read by MLflow's own
``dataframe_from_parsed_json`` with the signature's types, and one ``PyFuncModel.predict`` call,
which enforces the signature. If anything about that call fails (a bad value in one request,
a model that cannot take the batch, predictions that do not split by rows), every request is
redone on its own, so one bad request cannot fail the others and gets its own status.

On its own, a request goes exactly MLflow's way (``infer_and_parse_data``, then
``_validate_prediction_input``, then ``PyFuncModel.predict``) and errors get the statuses and
codes of MLflow's scoring server, so that no input a client sends can make the replica look
broken (a 5xx counts toward outlier ejection, the 5xx alerts and the bake rollback):

====================================================  ======  =========================
MLflow could not read the input (shape, JSON layout)   400     BAD_REQUEST
a value does not convert to its column's type          400     BAD_REQUEST
the signature's enforcement fails (missing column…)    400     INVALID_PARAMETER_VALUE
params that fail the params schema                     400     INVALID_PARAMETER_VALUE
the model raises an MlflowException                    its own status and code
the model raises anything else (its input rejected)    400     BAD_REQUEST †
the predictions cannot be written as JSON              500     INTERNAL_ERROR
====================================================  ======  =========================

† marked as the model's fault (``X-Modelplane-Fault: model``, :mod:`serving.blame`) when the
input passed the model's signature: the version's fault, not the client's nor the replica's.
"""

from __future__ import annotations

import json
import logging
import math
from io import BytesIO, StringIO
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.pyfunc import PyFuncModel, _validate_prediction_input, load_model
from mlflow.pyfunc.scoring_server import (
    _split_data_and_params_for_llm_input,
    infer_and_parse_data,
    parse_csv_input,
    parse_parquet_input,
)
from mlflow.types import DataType, Schema
from mlflow.utils.proto_json_utils import (
    MlflowFailedTypeConversion,
    NumpyEncoder,
    _get_jsonable_obj,
    dataframe_from_parsed_json,
)

from serving.runtime.pyfunc.batching import row_bounds
from serving.runtime.pyfunc.payload import CSV, INPUTS, LLM_INPUT, PARQUET, Invocation, InvocationError
from serving.runtime.pyfunc.responses import BAD_REQUEST, INVALID_PARAMETER_VALUE, Outcome, error_outcome

logger = logging.getLogger(__name__)

_numpy_encoder = NumpyEncoder()


def _numpy_to_json(value: Any) -> Any:
    converted, ok = _numpy_encoder.try_convert(value)
    if ok:
        return converted
    raise NotImplementedError(f"a prediction of type {type(value).__name__} is not JSON-serializable")


_encoder = msgspec.json.Encoder(enc_hook=_numpy_to_json)


def encode_predictions(raw: Any, wrapped: bool = True) -> bytes:
    """``{"predictions": ...}`` as MLflow writes it (DataFrames as records; NaN, Infinity and
    -Infinity as Python's ``json`` writes them); without the wrapper for a unified LLM request.

    >>> encode_predictions(np.array([1.5, np.inf, np.nan]))
    b'{"predictions": [1.5, Infinity, NaN]}'
    >>> encode_predictions({"choices": [{"text": "hi"}]}, wrapped=False)
    b'{"choices":[{"text":"hi"}]}'
    """
    document = _get_jsonable_obj(raw, pandas_orient="records")
    if wrapped:
        document = {"predictions": document}
    body = _encoder.encode(document)
    if b"null" in body:  # msgspec writes NaN and ±inf as null: MLflow's encoder writes them as numbers
        body = json.dumps(document, cls=NumpyEncoder).encode()
    return body


def _status_of(exc: MlflowException) -> tuple[int, str]:
    """The HTTP status and error code MLflow's server answers an MlflowException with."""
    return exc.get_http_status_code(), exc.error_code


def slice_rows(raw: Any, start: int, stop: int, total_rows: int) -> Any:
    """Rows ``[start, stop)`` of a batch's predictions; ValueError when they do not split by row."""
    if isinstance(raw, (pd.DataFrame, pd.Series)):
        if len(raw) != total_rows:
            raise ValueError(f"{len(raw)} predictions for {total_rows} rows")
        return raw.iloc[start:stop]
    if isinstance(raw, (np.ndarray, list)) and len(raw) == total_rows:
        return raw[start:stop]
    raise ValueError(f"predictions of type {type(raw).__name__} do not split by row")


def missing_value_columns(data: Any) -> list[str]:
    """Columns (or '<input>') holding null, NaN or ±inf values: a model that fails on those
    failed on the client's data, not on a bug of its own.

    >>> missing_value_columns(pd.DataFrame({"a": [1.0, float("inf")], "b": [1.0, 2.0], "c": ["x", None]}))
    ['a', 'c']
    >>> missing_value_columns([[1.0, float("nan")]]), missing_value_columns({"x": [1, 2]})
    (['<input>'], [])
    """
    def unusable(values: Any) -> bool:
        array = np.asarray(values, dtype=object)
        return bool(pd.isna(array).any() or any(isinstance(v, float) and math.isinf(v) for v in array.ravel()))

    try:
        if isinstance(data, pd.DataFrame):
            return [str(c) for c in data.columns if unusable(data[c].to_numpy())]
        if isinstance(data, dict):
            return [str(k) for k, v in data.items() if unusable(v)]
        return ["<input>"] if unusable(data) else []
    except Exception:  # noqa: BLE001 - ragged or exotic input: no evidence of missing values
        return []


def uniform_numeric_dtype(schema: Schema | None) -> type | None:
    """numpy's dtype for a column schema that is all ``double`` (float64) or all ``float`` (float32)."""
    if schema is None or not schema.has_input_names() or schema.is_tensor_spec():
        return None
    types = schema.input_types()
    for data_type, dtype in ((DataType.double, np.float64), (DataType.float, np.float32)):
        if all(t == data_type for t in types):
            return dtype
    return None


def numeric_frame(columns: tuple[str, ...], rows: list[list[Any]], dtype: type) -> pd.DataFrame | None:
    """Rows as a DataFrame of one numeric dtype in a single numpy conversion, or None when they do
    not convert to a (rows × columns) array. Used when every signature column has that dtype: the
    values are those of MLflow's reading (a DataFrame, then ``astype`` per column), ~10× faster.

    >>> numeric_frame(("a", "b"), [[1, "2.5"], [None, True]], np.float64).to_numpy().tolist()
    [[1.0, 2.5], [nan, 1.0]]
    """
    try:
        values = np.asarray(rows, dtype=dtype)
    except (TypeError, ValueError):
        return None
    if values.shape != (len(rows), len(columns)):
        return None
    return pd.DataFrame(values, columns=list(columns))


def _mlflow_message(exc: BaseException) -> str:
    message = exc.message if isinstance(exc, MlflowException) else str(exc)
    return message.removeprefix("Invalid input. ")


class PyfuncPredictor:
    """One loaded pyfunc model; call only from one thread at a time."""

    def __init__(self, model: PyFuncModel) -> None:
        self.model = model
        metadata = model.metadata
        self.input_schema = metadata.get_input_schema()
        self.params_schema = metadata.get_params_schema()
        self.flavor = metadata.flavors.get("python_function", {}).get("loader_module")
        # Type-hinted PythonModels validate their own input and take `inputs` as is (as in MLflow).
        self.takes_raw_inputs = bool(metadata._is_signature_from_type_hint())
        self.concatenates_frames = not self.takes_raw_inputs
        self.numeric_dtype = uniform_numeric_dtype(self.input_schema)
        self.numeric_columns = set(self.input_schema.input_names()) if self.numeric_dtype is not None else set()

    @classmethod
    def load(cls, model_dir: Path) -> PyfuncPredictor:
        return cls(load_model(str(model_dir)))

    def predict_batch(self, batch: list[Invocation]) -> list[Outcome]:
        """One outcome per request, in order. Never raises.

        Dataframe requests (one or many) take the fast path: one DataFrame, one ``predict``
        call that enforces the signature itself. If that raises, each request is redone on its
        own, which also finds out which request was at fault and with what status.
        """
        if self.concatenates_frames and all(item.frame is not None for item in batch):
            try:
                return self._predict_concatenated(batch)
            except Exception as exc:  # noqa: BLE001 - any failure: retry each request alone
                logger.debug("batch of %d failed (%r); predicting each request alone", len(batch), exc)
        return [self.predict_one(item) for item in batch]

    def _predict_concatenated(self, batch: list[Invocation]) -> list[Outcome]:
        columns = batch[0].frame.columns
        rows = [row for item in batch for row in item.frame.rows]
        split: dict[str, Any] = {"data": rows} if columns is None else {"columns": list(columns), "data": rows}
        # MLflow's own reading of a split frame (with the cast to the signature's types); then
        # PyFuncModel.predict enforces the signature and the params schema.
        frame = self._numeric_frame(columns, rows)
        if frame is None:
            frame = dataframe_from_parsed_json(split, pandas_orient="split", schema=self.input_schema)
        raw = self.model.predict(frame, params=batch[0].params)
        bounds = row_bounds([item.row_count for item in batch])
        return [Outcome(200, encode_predictions(slice_rows(raw, start, stop, len(rows)))) for start, stop in bounds]

    def _numeric_frame(self, columns: tuple[str, ...] | None, rows: list[list[Any]]) -> pd.DataFrame | None:
        if self.numeric_dtype is None or columns is None or not self.numeric_columns.issuperset(columns):
            return None
        return numeric_frame(columns, rows, self.numeric_dtype)

    def predict_one(self, item: Invocation) -> Outcome:
        """One request, exactly MLflow's way, with each failure mapped to MLflow's status."""
        try:
            data, params = self._parse(item)
        except InvocationError as exc:
            return error_outcome(exc.status, exc.message, exc.error_code)
        if not self.takes_raw_inputs and item.input_key != LLM_INPUT:
            try:
                data, params = _validate_prediction_input(data, params, self.input_schema, self.params_schema,
                                                          self.flavor)
            except Exception as exc:  # noqa: BLE001 - MLflow wraps every enforcement failure
                status, code = _status_of(exc) if isinstance(exc, MlflowException) else (400, BAD_REQUEST)
                cause = exc.__context__ or exc  # the concise reason, without MLflow's dump of the data
                return error_outcome(status, f"The input does not match the model signature: "
                                             f"{_mlflow_message(cause)} Signature inputs: {self.input_schema}.", code)
        try:
            raw = self.model.predict(data, params=params)
        except MlflowException as exc:
            status, code = _status_of(exc)
            return error_outcome(status, f"The model rejected the input: {_mlflow_message(exc)}", code)
        except Exception as exc:  # noqa: BLE001 - MLflow's server: the input was not one the model takes
            logger.debug("predict raised on a request", exc_info=True)
            missing = missing_value_columns(data)
            hint = (f"It holds missing or infinite (null/NaN/±Infinity) values in {missing}; send a finite value for "
                    f"every field. " if missing else "")
            # with a signature the input passed, the model failed on what it declared it takes:
            # the version's fault, counted for its canary and bake (serving.blame), not the replica's
            # (missing or infinite values are the client's data, whatever the signature allows)
            signed = self.input_schema is not None and item.input_key != LLM_INPUT and not missing
            return error_outcome(400, "Encountered an unexpected error while evaluating the model. Verify that the "
                                      f"input is compatible with the model for inference. {hint}"
                                      f"The model raised {type(exc).__name__}: {exc}", BAD_REQUEST, model_fault=signed)
        try:
            return Outcome(200, encode_predictions(raw, wrapped=item.input_key != LLM_INPUT))
        except Exception as exc:  # noqa: BLE001
            logger.exception("the predictions could not be encoded")
            return error_outcome(500, f"The model's predictions could not be encoded as JSON: {exc}")

    def _parse(self, item: Invocation) -> tuple[Any, dict[str, Any] | None]:
        """The model's input and params, read by MLflow's own parsers."""
        if item.input_key == LLM_INPUT:
            return _split_data_and_params_for_llm_input(item.input_value, self.params_schema)
        if self.takes_raw_inputs:
            if item.input_key != INPUTS:
                raise InvocationError(400, "This model has a type-hinted signature: send its input under 'inputs'.",
                                      INVALID_PARAMETER_VALUE)
            return item.input_value, item.params
        try:
            if item.input_key == CSV:
                return parse_csv_input(StringIO(item.input_value.decode("utf-8")), schema=self.input_schema), None
            if item.input_key == PARQUET:
                return parse_parquet_input(BytesIO(item.input_value)), None
            return infer_and_parse_data({item.input_key: item.input_value}, self.input_schema), item.params
        except UnicodeDecodeError as exc:
            raise InvocationError(400, f"The CSV body is not valid UTF-8: {exc}", BAD_REQUEST) from None
        except MlflowFailedTypeConversion as exc:
            raise InvocationError(400, f"{_mlflow_message(exc)} Signature inputs: {self.input_schema}.",
                                  exc.error_code) from None
        except MlflowException as exc:
            status, code = _status_of(exc)
            raise InvocationError(status, f"Could not read '{item.input_key}': {_mlflow_message(exc)}", code) from None
        except Exception as exc:  # noqa: BLE001 - MLflow's parser: anything it cannot read is bad input
            raise InvocationError(400, f"Could not read '{item.input_key}': {_mlflow_message(exc)}",
                                  BAD_REQUEST) from None
