"""Shared fixtures: databases (SQLite and the PostgreSQL server on 127.0.0.1:5432),
a real MLflow registry on SQLite, and free ports."""

from __future__ import annotations

import os

# MLflow decides at import whether to send usage telemetry. A self-hosted deployment turns it
# off (controlplane.settings.OFFLINE_ENV); so do the tests, whose offline checks would see it.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")
# No test reaches a model hub, and `up`'s processes run offline (OFFLINE_ENV). transformers writes
# the mode into a logged tokenizer's config, read when huggingface_hub is imported: a model logged
# here then has the same files as one logged by `up`'s processes, and the gate's results are shared.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import uuid
from pathlib import Path

import pytest
from hypothesis import settings
from sqlalchemy import create_engine, text

from benchmarks.polling import wait_for  # noqa: F401 - the tests import it from here
from controlplane import db
from serving.runtime.process import free_port  # noqa: F401 - the tests import it from here

# Timings never decide pass/fail on these shared machines: no hypothesis deadline (a first
# example that imports numpy under load took 478 ms against the default 200 ms).
settings.register_profile("modelplane", deadline=None)
settings.load_profile("modelplane")

from benchmarks.reliability.bed import POSTGRES_ADMIN_URL  # noqa: E402 - one definition, the fault bed's

# Under CI=true a test may skip only for what no CI machine has (docs/testing.md, "Skips"): every
# other part (PostgreSQL, FUSE, squashfs-tools, the registry, kubectl, promtool, the trace) is on the
# machine or installed by `make sysdeps`, so a skip for it is a missing part, and a failure there.
CI_SKIP_REASONS = ("KUBECONFIG does not point at a real cluster", "needs a GPU")


def skip_failure_in_ci(reason: str) -> str | None:
    """What a skip for ``reason`` fails with under CI=true; None when it may skip there."""
    if any(allowed in reason for allowed in CI_SKIP_REASONS):
        return None
    return f"skipped under CI=true: {reason}\n(only these may skip in CI: {'; '.join(CI_SKIP_REASONS)}; docs/testing.md)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        failure = skip_failure_in_ci(report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr))
        if failure is not None:
            report.outcome, report.longrepr = "failed", failure


# `make test` runs modules on parallel workers (pytest-xdist, ``--dist loadscope``: a module's
# tests stay together on one worker, in their order) and hands the modules out in collection
# order. These run longest, measured on 2 cores (docs/testing.md): they go first, longest
# first, so that no long module starts last and the workers finish together.
LONGEST_FIRST = (
    "tests/test_faults.py",  # `make test` runs it alone afterwards (`make test-faults`)
    "tests/test_deploy_gate.py",
    "tests/test_platform.py",
    "tests/test_deploy_gate_fp8.py",  # beside the deploy-gate module, not after it
    "tests/test_supervisor.py",
    "tests/test_serving_image.py",
    "tests/test_autoscale_live.py",
    "tests/test_vllm_runtime.py",
    "tests/test_amx.py",
    "tests/test_source_model.py",
    "tests/test_mlflow_conformance.py",  # six servers at once: mlflow models serve and a replica per model
    "tests/test_warm_pool.py",
    "tests/test_demo_models.py",
    "tests/test_kubernetes_pod.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: order within kept


@pytest.fixture(scope="session")
def tiny_llama_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """demo.tiny_llama's checkpoint (seed 0), built once for the whole run: the first worker to
    ask builds it under a lock in the run's shared temporary directory, the others wait and read it.
    Tests take copies (:func:`tiny_llama`); tests/test_demo_models.py builds it again and checks
    that both builds are the same bytes."""
    import fcntl
    import shutil

    from demo.tiny_llama import build_tiny_llama

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # pytest-N/, above popen-gwK/
    built = shared / "tiny-llama-seed0"
    with (shared / "tiny-llama-seed0.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (built / "model.safetensors").is_file():
            partial = shared / "tiny-llama-seed0.partial"
            shutil.rmtree(partial, ignore_errors=True)
            build_tiny_llama(partial)
            partial.rename(built)
    return built


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_build: Path):
    """``tiny_llama(dest)``: a copy of the run's tiny Llama checkpoint at ``dest`` (returned)."""
    import shutil

    def copy(dest: Path) -> Path:
        return Path(shutil.copytree(tiny_llama_build, dest))

    return copy


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'controlplane.db'}"


@pytest.fixture
def postgres_url():
    """A fresh database on the local PostgreSQL server, dropped afterwards.

    Skipped when no server answers, except in CI (CI=true), where it must exist.
    """
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"modelplane_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001 - any connection failure means "no server here"
        admin.dispose()
        if os.environ.get("CI"):
            raise
        pytest.skip(f"PostgreSQL at {POSTGRES_ADMIN_URL} is not reachable: {exc}")
    yield POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request) -> str:
    """Every control-plane test that takes this fixture runs on both databases."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def migrated_engine(database_url: str):
    db.upgrade(database_url)
    engine = db.make_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def mlflow_uri(tmp_path: Path) -> str:
    """A real MLflow tracking and registry store (SQLite), no server."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def mlflow_experiment(mlflow_uri: str, tmp_path: Path) -> str:
    """An experiment whose artifacts live under tmp_path (not ./mlruns in the checkout)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    return client.create_experiment("tests", artifact_location=(tmp_path / "artifacts").as_uri())


@pytest.fixture(scope="module")
def iris(tmp_path_factory):
    """The demo iris model registered in a fresh MLflow: (tracking URI, its downloaded model directory)."""
    from mlflow import MlflowClient

    from demo.iris import log_iris
    from pipelines.registry import MlflowRegistry

    root = tmp_path_factory.mktemp("iris")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).create_experiment("modelplane-demo", artifact_location=(root / "a").as_uri())
    log_iris(uri)
    return uri, Path(MlflowRegistry(uri).download("iris", "1", root / "model"))


@pytest.fixture(scope="module")
def iris_dir(iris) -> Path:
    """The demo iris model's directory (an MLflow pyfunc model)."""
    return iris[1]


@pytest.fixture(scope="module")
def quick_model_dir(tmp_path_factory) -> Path:
    """An MLflow pyfunc model for the tests of what starts, watches and stops replicas rather than of
    what they serve: demo.service_time_model at 1 ms a row (``{"x": [1.0]}`` in, ``{"served": [1]}``
    out). Its replica is ready after 2.3 CPU-seconds against the iris model's 8 (2-core Xeon,
    2026-12-07): no scikit-learn, and no skops, whose list of trusted types imports every
    scikit-learn module and, through scikit-learn's array-API shims, torch where it is installed."""
    from demo.service_time_model import save_service_time_model

    return save_service_time_model(tmp_path_factory.mktemp("quick-model") / "model", 1.0)


def copy_without_example_or_signature(model_dir: Path, dest: Path) -> Path:
    """A copy of an MLflow model as if logged with neither an input example nor a signature."""
    import shutil

    import yaml

    copy = Path(shutil.copytree(model_dir, dest))
    for name in ("serving_input_example.json", "input_example.json"):
        (copy / name).unlink(missing_ok=True)
    mlmodel = yaml.safe_load((copy / "MLmodel").read_text())
    for key in ("signature", "saved_input_example_info"):
        mlmodel.pop(key, None)
    (copy / "MLmodel").write_text(yaml.safe_dump(mlmodel))
    return copy


# Each phase's (nodeid, worker, start, stop), gathered on the controller, for the modules'
# spans printed at the end of the run (tests/module_spans.py).
PHASES: list[tuple[str, str, float, float]] = []


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # pytest-xdist's worker, on the controller
    worker = node.gateway.id if node is not None else os.environ.get("PYTEST_XDIST_WORKER", "main")
    PHASES.append((report.nodeid, worker, report.start, report.stop))


def pytest_terminal_summary(terminalreporter):
    from tests.module_spans import summary

    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        for line in summary(PHASES):
            terminalreporter.write_line(line)
