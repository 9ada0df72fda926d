"""Start-up traces kept beside the environment layers, so that a new version of a model does not
start a replica under strace again to learn what its predecessor's start already showed.

A trace (:mod:`images.startup_trace`) orders each layer's files: the environment's, which
matter only when its layer is built (once per environment fingerprint), and the model's,
which a runtime opens by name (``MLmodel`` and ``model.skops``; ``config.json``, the tokenizer
and ``model.safetensors``). So a trace is keyed by the environment's fingerprint, the runtime,
its settings and the model directory's file names, not the files' bytes: a retrained version
with the same files reuses its predecessor's trace, and a model that adds or renames a file is
traced again. The trace only orders what is prefetched first; a stale one costs start-up
speed, never correctness.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

ROLES = ("env", "model")


def trace_key(fingerprint: str, runtime: str, runtime_config: dict, model_dir: Path) -> str:
    """SHA-256 of what decides a start-up trace.

    >>> import tempfile; d = Path(tempfile.mkdtemp()); _ = (d / "MLmodel").write_text("a")
    >>> a = trace_key("f1", "pyfunc", {"workers": 1}, d)
    >>> _ = (d / "MLmodel").write_text("retrained"); a == trace_key("f1", "pyfunc", {"workers": 1}, d)
    True
    >>> _ = (d / "extra.json").write_text("{}"); a == trace_key("f1", "pyfunc", {"workers": 1}, d)
    False
    """
    model_dir = Path(model_dir)
    files = sorted(path.relative_to(model_dir).as_posix() for path in model_dir.rglob("*")
                   if path.is_file() or path.is_symlink())
    described = json.dumps({"environment": fingerprint, "runtime": runtime, "runtime_config": runtime_config,
                            "model_files": files}, sort_keys=True, default=str)
    return hashlib.sha256(described.encode()).hexdigest()


def cached_trace(cache_root: Path, key: str,
                 record: Callable[[], dict[str, list[str]]]) -> tuple[dict[str, list[str]], bool]:
    """(the trace, whether it came from the cache): the one stored under ``key`` in
    ``cache_root``, else what ``record`` returns, stored there (written whole, then renamed).
    A stored trace that cannot be read is recorded again."""
    path = Path(cache_root) / f"trace-{key[:32]}.json"
    try:
        traced = json.loads(path.read_text())
        if (isinstance(traced, dict) and set(traced) == set(ROLES)
                and all(isinstance(files, list) and all(isinstance(f, str) for f in files) for files in traced.values())):
            return traced, True
    except (OSError, ValueError):
        pass
    traced = record()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(traced))
    os.replace(partial, path)
    return traced, False
