"""MLflow's scoring protocol, side by side with the real `mlflow models serve`.

Each request below (the cases of MLflow's own scoring-server tests, and the client mistakes a
shared endpoint sees) goes to three servers of the same model: `mlflow models serve` (the
anchor, never a copy of its answers), a bare modelplane pyfunc replica, and the router in front
of that replica. Each must give the anchor's status, its kind of body (JSON or plain text), its
``error_code`` for an error, and the same predictions for a 200. A new MLflow version that
changes an answer turns this red.

Where modelplane deliberately differs (no stack trace in an error, 413 for a body over the
limit, 415 for a request without a Content-Type where MLflow's server fails with a 500) is in
docs/usage.md and not sent here.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import mlflow.pyfunc
import numpy as np
import pandas as pd
import pytest

from serving.runtime.base import RuntimeConfig
from tests.conftest import free_port, wait_for
from tests.test_pyfunc_server import ServerProcess
from tests.test_router import IRIS_TOKEN, auth, make_router, table_for

pytestmark = pytest.mark.slow

IRIS_COLUMNS = ["sepal length (cm)", "sepal width (cm)", "petal length (cm)", "petal width (cm)"]
IRIS_ROWS = [[5.1, 3.5, 1.4, 0.2], [6.3, 3.3, 6.0, 2.5]]
TWO_COLUMNS = [[5.1, 3.5], [6.3, 3.3], [5.7, 2.8]]
JSON = "application/json"


class Behaviours(mlflow.pyfunc.PythonModel):
    """x times the param k; x == 13 is refused (the model rejects its input), -1 gives -inf."""

    def predict(self, context, model_input, params=None):
        x = model_input["x"].to_numpy(dtype=float)
        if (x == 13).any():
            raise ValueError("13 is not a value this model takes")
        k = (params or {}).get("k", 1)
        return np.where(x == -1, -np.inf, x * k)


def save_models(root: Path) -> dict[str, Path]:
    """Three models: a scikit-learn one without a signature (as MLflow's tests save it), one with
    a signature, and a PythonModel with a signature and a params schema."""
    from mlflow.models import ModelSignature, infer_signature
    from mlflow.types import ParamSchema, ParamSpec
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    X, y = load_iris(return_X_y=True, as_frame=True)
    paths = {name: root / name for name in ("unsigned", "signed", "behaviours")}
    mlflow.sklearn.save_model(LogisticRegression(max_iter=300).fit(X.values[:, :2], y), str(paths["unsigned"]))
    mlflow.sklearn.save_model(LogisticRegression(max_iter=300).fit(X, y), str(paths["signed"]),
                              signature=infer_signature(X, y))
    signature = ModelSignature(inputs=infer_signature(pd.DataFrame({"x": [1.0]})).inputs,
                               params=ParamSchema([ParamSpec("k", "long", 1)]))
    mlflow.pyfunc.save_model(str(paths["behaviours"]), python_model=Behaviours(), pip_requirements=[],
                             signature=signature)
    return paths


class MlflowServe:
    """`mlflow models serve` as a user starts it, on this machine's environment."""

    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        bin_dir = Path(sys.executable).parent  # its uvicorn is looked up on PATH
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [str(bin_dir / "mlflow"), "models", "serve", "-m", str(model_dir), "--env-manager", "local",
                 "--host", "127.0.0.1", "--port", str(self.port)],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.log_path = log_path

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        def up() -> bool:
            assert self.process.poll() is None, self.log_path.read_text()[-3000:]
            try:
                return httpx.get(f"{self.url}/ping", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout_s, "mlflow models serve to answer /ping")

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)  # the CLI and the uvicorn it started
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Per model: the anchor and a modelplane replica, all six started at once."""
    root = tmp_path_factory.mktemp("conformance")
    paths = save_models(root)
    started = {}
    try:
        for name, path in paths.items():
            started[name] = (MlflowServe(path, root / f"{name}-mlflow.log"),
                             ServerProcess(path, root / f"{name}-replica.log", RuntimeConfig(model_name=name)))
        for anchor, replica in started.values():
            anchor.wait_healthy()
            replica.wait_healthy()
        yield started
    finally:
        for anchor, replica in started.values():
            anchor.stop()
            replica.stop()


def parquet(frame: pd.DataFrame) -> bytes:
    buffer = io.BytesIO()
    frame.to_parquet(buffer)
    return buffer.getvalue()


def records(rows, columns) -> list[dict]:
    return [dict(zip(columns, row)) for row in rows]


# (model, content type, body): bodies are sent as given (str: as written, so NaN stays NaN)
CASES = [
    # MLflow's tests: malformed and misshaped JSON
    ("unsigned", JSON, "this is,,,, not valid json"),
    ("unsigned", JSON, "1"),
    ("unsigned", JSON, '"1"'),
    ("unsigned", JSON, "[1]"),
    ("unsigned", JSON, {"not": "a serialized dataframe"}),
    ("unsigned", JSON, {"dataframe_records": [], "dataframe_split": {"data": []}}),
    ("unsigned", JSON, {"dataframe_split": records(TWO_COLUMNS, ["0", "1"])}),
    ("unsigned", JSON, {"dataframe_records": {"columns": ["0", "1"], "data": TWO_COLUMNS}}),
    ("unsigned", JSON, {"dataframe_split": {"index": [1, 2], "data": [[1], [2], [3]]}}),
    # MLflow's tests: an input the model cannot take, with no signature to catch it first
    ("unsigned", JSON, {"dataframe_split": {"data": [[i] for i in range(10)]}}),
    ("unsigned", JSON, {"inputs": [[1.0, 2.0, 3.0]]}),
    ("unsigned", JSON, {"dataframe_split": {"data": [["a", "b"]]}}),
    ("unsigned", JSON, '{"dataframe_split": {"data": [[NaN, 1.0]]}}'),
    ("unsigned", JSON, '{"dataframe_split": {"data": [[Infinity, -Infinity], [1e400, 1.0]]}}'),
    ("unsigned", JSON, {"dataframe_split": {"data": []}}),
    # MLflow's tests: every input format and content type it reads
    ("unsigned", JSON, {"dataframe_records": records(TWO_COLUMNS, ["0", "1"])}),
    ("unsigned", JSON + "; charset=UTF-8", {"dataframe_records": records(TWO_COLUMNS, ["0", "1"])}),
    ("unsigned", JSON, {"dataframe_split": {"columns": ["0", "1"], "data": TWO_COLUMNS}}),
    ("unsigned", JSON, {"instances": TWO_COLUMNS}),
    ("unsigned", JSON, {"inputs": TWO_COLUMNS}),
    ("unsigned", JSON, {"dataframe_split": {"data": TWO_COLUMNS}, "params": {"ignored": 1}}),
    ("unsigned", "text/csv", "a,b\n5.1,3.5\n6.3,3.3\n"),
    ("unsigned", "text/csv", ""),
    ("unsigned", "application/vnd.apache.parquet", parquet(pd.DataFrame(TWO_COLUMNS, columns=["a", "b"]))),
    ("unsigned", "application/vnd.apache.parquet", b"not parquet"),
    # content types it does not read
    ("unsigned", "not_a_supported_content_type", {"inputs": TWO_COLUMNS}),
    ("unsigned", "text/plain", {"inputs": TWO_COLUMNS}),
    ("unsigned", JSON + "; something=something", {"inputs": TWO_COLUMNS}),
    ("unsigned", JSON + "; charset=latin-1", {"inputs": TWO_COLUMNS}),
    # chat, completion and embedding bodies (MLflow's unified LLM input) on a model that is not one
    ("unsigned", JSON, {"messages": [{"role": "user", "content": "hi"}]}),
    ("unsigned", JSON, {"prompt": "hi"}),
    ("unsigned", JSON, {"input": ["hi"]}),
    # a signature: what enforcing it finds
    ("signed", JSON, {"dataframe_split": {"columns": IRIS_COLUMNS, "data": IRIS_ROWS}}),
    ("signed", JSON, {"dataframe_records": records(IRIS_ROWS, IRIS_COLUMNS)}),
    ("signed", JSON, {"instances": records(IRIS_ROWS, IRIS_COLUMNS)}),
    ("signed", JSON, {"inputs": {c: [r[i] for r in IRIS_ROWS] for i, c in enumerate(IRIS_COLUMNS)}}),
    ("signed", JSON, {"dataframe_split": {"columns": IRIS_COLUMNS[:3], "data": [r[:3] for r in IRIS_ROWS]}}),
    ("signed", JSON, {"dataframe_split": {"columns": IRIS_COLUMNS, "data": [["wide", 3.5, 1.4, 0.2]]}}),
    ("signed", JSON, {"dataframe_split": {"columns": IRIS_COLUMNS, "data": [[None, 3.5, 1.4, 0.2]]}}),
    ("signed", JSON, {"dataframe_split": {"columns": [*IRIS_COLUMNS, "extra"], "data": [[*IRIS_ROWS[0], 1]]}}),
    ("signed", JSON, {"dataframe_split": {"columns": IRIS_COLUMNS, "data": [[1.0, 2.0, 3.0]]}}),
    ("signed", JSON, {"dataframe_split": {"columns": IRIS_COLUMNS, "data": IRIS_ROWS}, "params": {"a": 1}}),
    ("signed", "text/csv", ",".join(IRIS_COLUMNS) + "\n" + "\n".join(",".join(map(str, r)) for r in IRIS_ROWS)),
    ("signed", "text/csv", "a,b\n1,2\n"),
    ("signed", JSON, {"messages": [{"role": "user", "content": "hi"}]}),
    # a model that rejects some values, returns -inf for another, and takes a params schema
    ("behaviours", JSON, {"dataframe_split": {"columns": ["x"], "data": [[1.0], [2.5]]}}),
    ("behaviours", JSON, {"dataframe_split": {"columns": ["x"], "data": [[13.0]]}}),
    ("behaviours", JSON, {"dataframe_split": {"columns": ["x"], "data": [[-1.0], [3.0]]}}),
    ("behaviours", JSON, '{"dataframe_split": {"columns": ["x"], "data": [[NaN]]}}'),
    ("behaviours", JSON, {"dataframe_split": {"columns": ["x"], "data": [[2.0]]}, "params": {"k": 3}}),
    ("behaviours", JSON, {"dataframe_split": {"columns": ["x"], "data": [[2.0]]}, "params": {"k": "three"}}),
    ("behaviours", JSON, {"dataframe_split": {"columns": ["x"], "data": [[2.0]]}, "params": [3]}),
    ("behaviours", JSON, {"dataframe_split": {"columns": ["x"], "data": [[2.0]]}, "params": {"unknown": 3}}),
    ("behaviours", JSON, {"dataframe_records": [{"x": 1.0}, {"x": "two"}]}),
    ("behaviours", JSON, {"prompt": "hi"}),
]


def body_of(payload) -> bytes:
    if isinstance(payload, bytes):
        return payload
    return (payload if isinstance(payload, str) else json.dumps(payload)).encode()


def answer(response) -> tuple:
    """What a client can tell apart: the status, JSON or text, and the error code or predictions."""
    kind = response.headers.get("content-type", "").split(";")[0]
    if kind != "application/json":
        return response.status_code, kind
    document = json.loads(response.content)  # Python's reader: NaN and Infinity are numbers
    if response.status_code == 200:
        return 200, kind, json.dumps(document, sort_keys=True)  # NaN == NaN as text
    return response.status_code, kind, document.get("error_code")


@pytest.mark.parametrize("model, content_type, payload", CASES,
                         ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(CASES)])
def test_the_replica_and_the_router_answer_as_mlflow_models_serve_does(servers, model, content_type, payload):
    anchor, replica = servers[model]
    headers = {"content-type": content_type}
    expected = answer(httpx.post(f"{anchor.url}/invocations", content=body_of(payload), headers=headers, timeout=60))
    bare = httpx.post(f"{replica.url}/invocations", content=body_of(payload), headers=headers, timeout=60)
    assert answer(bare) == expected, bare.text[:500]
    with make_router(table_for([], [replica.url])) as router:
        routed = router.post("/serving-endpoints/iris/invocations", content=body_of(payload),
                             headers=headers | auth(IRIS_TOKEN))
    assert answer(routed) == expected, routed.text[:500]
    if bare.status_code >= 400 and "json" in expected[1]:
        assert bare.json()["message"], "an error says what was wrong"


def test_version_and_ping_answer_as_mlflow_models_serve_does(servers):
    anchor, replica = servers["signed"]
    assert httpx.get(f"{replica.url}/version").text == httpx.get(f"{anchor.url}/version").text == mlflow.__version__
    assert httpx.get(f"{replica.url}/ping").status_code == httpx.get(f"{anchor.url}/ping").status_code == 200


def test_a_model_failing_on_input_its_signature_accepts_counts_against_its_revision_not_the_replica(servers):
    """Both answers are MLflow's 400; only the signed model's is the version's fault: the router
    counts it among the revision's failed answers (which the canary and the bake judge), and
    neither ejects the replica."""
    from tests.test_router import ADMIN_TOKEN

    signed, unsigned, iris = servers["behaviours"][1], servers["unsigned"][1], servers["signed"][1]
    thirteen = {"dataframe_split": {"columns": ["x"], "data": [[13.0]]}}  # passes the signature; the model raises
    one_column = {"dataframe_split": {"data": [[1.0]]}}  # no signature: the model raises on a client's mistake
    missing = {"dataframe_split": {"columns": IRIS_COLUMNS, "data": [[None, 3.5, 1.4, 0.2]]}}  # the client's data
    for replica, body, fault in ((signed, thirteen, "model"), (unsigned, one_column, None), (iris, missing, None)):
        with make_router(table_for([], [replica.url])) as router:
            answers = [router.post("/serving-endpoints/iris/invocations", json=body, headers=auth(IRIS_TOKEN))
                       for _ in range(6)]
            seen = router.get("/internal/in-flight", headers=auth(ADMIN_TOKEN)).json()["endpoints"]["iris"]
            [row] = router.get("/internal/replicas", headers=auth(ADMIN_TOKEN)).json()["endpoints"]["iris"]["replicas"]
        assert {(a.status_code, a.headers.get("x-modelplane-fault")) for a in answers} == {(400, fault)}
        assert (seen["requests"], seen["errors"]) == (6, 6 if fault else 0)
        assert (row["ejected"], row["consecutive_failures"]) == (False, 0)  # 6 answers: 5 failures would eject


def test_mlflows_own_scoring_client_gets_the_same_predictions_and_errors_from_the_replica(servers):
    """`mlflow.pyfunc.scoring_server.client.ScoringServerClient` (``requests`` underneath, the
    input written by MLflow's ``dump_input_data``), pointed at the anchor and at the replica:
    the same predictions for DataFrames, records and params, the same failure for a bad column."""
    from urllib.parse import urlsplit

    from mlflow.pyfunc.scoring_server.client import ScoringServerClient

    def client(server) -> ScoringServerClient:
        where = urlsplit(server.url)
        return ScoringServerClient(where.hostname, where.port)

    frame = pd.DataFrame([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], columns=IRIS_COLUMNS)
    calls = [("signed", frame, None), ("signed", frame.to_dict(orient="records"), None),
             ("behaviours", pd.DataFrame({"x": [1.0, 2.0]}), {"k": 3}), ("unsigned", frame.iloc[:, :2].values, None)]
    for model, data, params in calls:
        anchor, replica = servers[model]
        expected = client(anchor).invoke(data, params=params).get_predictions()
        seen = client(replica).invoke(data, params=params).get_predictions()
        pd.testing.assert_frame_equal(pd.DataFrame(seen), pd.DataFrame(expected))
    anchor, replica = servers["signed"]
    assert client(replica).get_version() == client(anchor).get_version() == mlflow.__version__
    failures = []
    for server in (anchor, replica):
        with pytest.raises(Exception, match="Invocation failed") as raised:
            client(server).invoke(pd.DataFrame({"no such column": [1.0]}))
        failures.append(str(raised.value).split("response:")[0])
    assert failures[0] == failures[1] and "error code 400" in failures[1]
