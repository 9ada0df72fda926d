"""The MLflow model behind the server: parse with MLflow, enforce the signature, predict, encode.

:meth:`PyfuncPredictor.predict_batch` runs in the worker thread. Dataframe requests that share a
batch key (one request or many) become one DataFrame, read by MLflow's own
``dataframe_from_parsed_json`` with the signature's types, and one ``PyFuncModel.predict`` call,
which enforces the signature. If anything about that call fails (a bad value in one request,
a model that cannot take the batch, predictions that do not split by rows), every request is
redone on its own, so one bad request cannot fail the others and gets its own status.

On its own, a request goes exactly MLflow's way (``infer_and_parse_data``, then
``_validate_prediction_input``, then ``PyFuncModel.predict``) and errors map to statuses:

====================================================  ======
MLflow could not read the input (shape, JSON layout)   400
a value does not convert to its column's type          422
the signature's enforcement fails (missing column…)    422
the model raises on input holding nulls/NaN            422
the model raises on input that passed the signature    500
====================================================  ======
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.pyfunc import PyFuncModel, _validate_prediction_input, load_model
from mlflow.pyfunc.scoring_server import infer_and_parse_data
from mlflow.types import DataType, Schema
from mlflow.utils.proto_json_utils import (
    MlflowFailedTypeConversion,
    NumpyEncoder,
    _get_jsonable_obj,
    dataframe_from_parsed_json,
)

from serving.runtime.pyfunc.batching import row_bounds
from serving.runtime.pyfunc.payload import INPUTS, Invocation, InvocationError
from serving.runtime.pyfunc.responses import Outcome, error_outcome

logger = logging.getLogger(__name__)

_numpy_encoder = NumpyEncoder()


def _numpy_to_json(value: Any) -> Any:
    converted, ok = _numpy_encoder.try_convert(value)
    if ok:
        return converted
    raise NotImplementedError(f"a prediction of type {type(value).__name__} is not JSON-serializable")


_encoder = msgspec.json.Encoder(enc_hook=_numpy_to_json)


def encode_predictions(raw: Any) -> bytes:
    """``{"predictions": ...}`` as MLflow writes it (DataFrames as records; NaN as null)."""
    return _encoder.encode({"predictions": _get_jsonable_obj(raw, pandas_orient="records")})


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
    """Columns (or '<input>') holding null/NaN values, to tell bad input from a model bug."""
    try:
        if isinstance(data, pd.DataFrame):
            return [str(c) for c in data.columns[data.isna().any().to_numpy()]]
        if isinstance(data, dict):
            return [str(k) for k, v in data.items() if pd.isna(np.asarray(v, dtype=object)).any()]
        return ["<input>"] if pd.isna(np.asarray(data, dtype=object)).any() else []
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
        """One request, exactly MLflow's way, with each failure mapped to its status."""
        try:
            data = self._parse(item)
        except InvocationError as exc:
            return error_outcome(exc.status, exc.message)
        params = item.params
        if not self.takes_raw_inputs:
            try:
                data, params = _validate_prediction_input(data, params, self.input_schema, self.params_schema,
                                                          self.flavor)
            except Exception as exc:  # noqa: BLE001 - MLflow wraps every enforcement failure
                cause = exc.__context__ or exc  # the concise reason, without MLflow's dump of the data
                return error_outcome(422, f"The input does not match the model signature: {_mlflow_message(cause)}"
                                          f" Signature inputs: {self.input_schema}.")
        try:
            raw = self.model.predict(data, params=params)
        except Exception as exc:  # noqa: BLE001 - the model's own failure
            if self.takes_raw_inputs and isinstance(exc, MlflowException) and exc.error_code in (
                    "INVALID_PARAMETER_VALUE", "BAD_REQUEST"):
                return error_outcome(422, f"The input does not match the model's type hints: {_mlflow_message(exc)}")
            missing = missing_value_columns(data)
            if missing:
                return error_outcome(422, f"The model failed on missing (null/NaN) values in {missing}; send a "
                                          f"value for every field. Model error: {type(exc).__name__}: {exc}")
            logger.exception("predict failed")
            return error_outcome(500, f"The model raised {type(exc).__name__}: {exc}")
        try:
            return Outcome(200, encode_predictions(raw))
        except Exception as exc:  # noqa: BLE001
            return error_outcome(500, f"The model's predictions could not be encoded as JSON: {exc}")

    def _parse(self, item: Invocation) -> Any:
        if self.takes_raw_inputs:
            if item.input_key != INPUTS:
                raise InvocationError(400, "This model has a type-hinted signature: send its input under 'inputs'.")
            return item.input_value
        try:
            return infer_and_parse_data({item.input_key: item.input_value}, self.input_schema)
        except MlflowFailedTypeConversion as exc:
            raise InvocationError(422, f"{_mlflow_message(exc)} Signature inputs: {self.input_schema}.") from None
        except Exception as exc:  # noqa: BLE001 - MLflow's parser: anything it cannot read is bad input
            raise InvocationError(400, f"Could not read '{item.input_key}': {_mlflow_message(exc)}") from None
