"""Run one checkpoint on the real engine for a bounded evaluation, and remember what it scored.

The engine is started exactly as a replica would be (``VllmRuntime.command``), so what the
gate measures is what would be served, then stopped with its whole session. Results are
kept beside the model version (``<model store>/<model>/v<N>/eval/<dataset>.<step>.json``)
with a fingerprint of the checkpoint files and one of the evaluation set, so the revision
now serving is not evaluated again on every deploy, and neither a changed checkpoint nor a
changed evaluation set ever reuses a stale result.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from evaluation.datasets import EvalSet
from evaluation.engine_eval import EvalResult, evaluate
from serving.runtime.base import RuntimeConfig
from serving.runtime.process import free_port, running_server
from serving.runtime.vllm_runtime import VllmRuntime

EVAL_MODEL_NAME = "candidate"
FINGERPRINTED = (".safetensors", ".json", ".jinja", ".model")


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


def cache_path(model_dir: Path, dataset: str) -> Path:
    """``…/gec/v3/quantized`` → ``…/gec/v3/eval/gec-heldout.quantized.json``."""
    model_dir = Path(model_dir)
    return model_dir.parent / "eval" / f"{dataset}.{model_dir.name}.json"


def cached_result(model_dir: Path, eval_set: EvalSet) -> EvalResult | None:
    path = cache_path(model_dir, eval_set.name)
    if not path.is_file():
        return None
    stored = json.loads(path.read_text())
    if stored.get("fingerprint") != fingerprint(model_dir) or stored.get("eval_set") != eval_set.fingerprint:
        return None
    return EvalResult.from_json(stored["result"])


def store_result(model_dir: Path, eval_set: EvalSet, result: EvalResult) -> None:
    path = cache_path(model_dir, eval_set.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps({"fingerprint": fingerprint(model_dir), "eval_set": eval_set.fingerprint,
                                   "result": result.to_json()}))
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


def evaluate_checkpoint(model_dir: Path, eval_set: EvalSet, log_path: Path, *, use_cache: bool = True,
                        log: Callable[[str], None] = print) -> EvalResult:
    """``eval_set`` on ``model_dir`` served by the engine, from the cache when it is still valid."""
    if use_cache:
        hit = cached_result(model_dir, eval_set)
        if hit is not None:
            log(f"{model_dir}: {eval_set.name} result from {cache_path(model_dir, eval_set.name)}")
            return hit
    log(f"{model_dir}: starting the engine for {eval_set.name} (log: {log_path})")
    with engine_for(model_dir, log_path) as base:
        result = evaluate(base, EVAL_MODEL_NAME, eval_set)
    store_result(model_dir, eval_set, result)
    return result
