"""``python -m serving.runtime.pyfunc --model-dir DIR --host H --port P [--workers N] ...``: the composition root.

Thread-count variables are set here, before numpy or any model library is imported, from the
cgroup CPU quota divided across the workers (:func:`.config.thread_env`); values already in the
environment (e.g. from :class:`~.runtime.PyfuncRuntime`) win.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from serving.runtime.cpu import available_cpus
from serving.runtime.pyfunc.config import (
    DEFAULT_MAX_BATCH_ROWS,
    DEFAULT_MAX_BATCH_WAIT_MS,
    DEFAULT_MAX_BODY_BYTES,
    PyfuncServerConfig,
    thread_env,
)

OFFLINE_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}


def parse_args(argv: list[str] | None) -> PyfuncServerConfig:
    parser = argparse.ArgumentParser(prog="python -m serving.runtime.pyfunc",
                                     description="Serve an MLflow pyfunc model on MLflow's /invocations protocol.")
    parser.add_argument("--model-dir", type=Path, required=True, help="a local MLflow model directory (has MLmodel)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--workers", type=int, default=1, help="server processes sharing the port")
    parser.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_ROWS,
                        help="most rows in one predict call (default %(default)s)")
    parser.add_argument("--max-batch-wait-ms", type=float, default=DEFAULT_MAX_BATCH_WAIT_MS,
                        help="longest a request waits for others to share its predict call (default %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies get 413 (default 8 MiB)")
    args = parser.parse_args(argv)
    if not (args.model_dir / "MLmodel").is_file():
        parser.error(f"--model-dir {args.model_dir} has no MLmodel file: pass a downloaded MLflow model directory")
    try:
        return PyfuncServerConfig(model_dir=args.model_dir, host=args.host, port=args.port, workers=args.workers,
                                  max_batch_rows=args.max_batch_size, max_batch_wait_ms=args.max_batch_wait_ms,
                                  max_body_bytes=args.max_body_bytes)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    for name, value in {**OFFLINE_ENV, **thread_env(available_cpus(), config.workers)}.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("_MLFLOW_IS_IN_SERVING_ENVIRONMENT", "true")  # as `mlflow models serve` sets it

    from serving.runtime.pyfunc.server import configure_logging, serve

    configure_logging()
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
