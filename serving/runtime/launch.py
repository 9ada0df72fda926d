"""``python -m serving.runtime.launch``: start a runtime's server in this process's place.

What the local supervisor does before ``Popen``, done inside the replica's own container: the
runtime's ``command`` reads this process's cgroup (CPU quota, memory limit) to size threads and
the KV cache, and the server replaces this process (``exec``), so it receives the pod's
signals directly. The Kubernetes backend starts every replica pod with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from serving.runtime.base import RuntimeConfig
from serving.runtime.process import replica_environment
from serving.runtime.registry import runtime_for


def runtime_config(model_name: str, config_json: str) -> RuntimeConfig:
    """The spec's replica options as a RuntimeConfig; SystemExit naming what is wrong.

    >>> runtime_config("gec", '{"workers": 2}').workers
    2
    >>> runtime_config("gec", '{"threads": 2}')
    Traceback (most recent call last):
    SystemExit: --config-json: unknown replica option(s) threads; known: api_server_count, cpu_cores, gpus, max_batch_size, max_batch_wait_ms, memory_gib, workers
    """
    try:
        options = json.loads(config_json)
    except ValueError as exc:
        raise SystemExit(f"--config-json is not JSON: {exc}") from None
    known = set(RuntimeConfig.__dataclass_fields__) - {"model_name"}
    if not isinstance(options, dict) or set(options) - known:
        unknown = sorted(set(options) - known) if isinstance(options, dict) else ["(not an object)"]
        raise SystemExit(f"--config-json: unknown replica option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return RuntimeConfig(model_name=model_name, **options)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m serving.runtime.launch")
    parser.add_argument("--runtime", required=True, choices=("vllm", "pyfunc"))
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--config-json", default="{}")
    args = parser.parse_args(argv)
    if not args.model_dir.is_dir():
        raise SystemExit(f"--model-dir {args.model_dir} is not a directory (is the serving image mounted?)")
    config = runtime_config(args.model_name, args.config_json)
    launch = runtime_for(args.runtime).command(args.model_dir, args.host, args.port, config)
    sys.stdout.flush()
    os.execvpe(launch.argv[0], launch.argv, replica_environment(launch.env))


if __name__ == "__main__":
    main()
