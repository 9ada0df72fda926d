"""The vLLM runtime's settings that come from the platform's environment, parsed strictly.

Each ``*_from_env`` reads one ``MODELPLANE_VLLM_*`` variable (docs/configuration.md), gives
the default where it is unset, and refuses anything else with the variable's name in the
message, so that a misspelt value stops ``up`` instead of being ignored.
"""

from __future__ import annotations

import os

# How vLLM runs the model on CPU (``--distributed-executor-backend``): "uni" in the engine-core
# process, "mp" in a worker process of its own (vLLM's CPU default).
CPU_EXECUTORS = ("uni", "mp")
# How the API server starts the engine-core process on CPU: "fork" (a copy of the API server,
# whose imports it shares), "spawn" (a new interpreter that imports torch and vLLM again: what
# vLLM's CPU platform forces), "auto" (fork with the "uni" executor, spawn with "mp").
CPU_ENGINE_STARTS = ("auto", "fork", "spawn")


def _choice(environ, name: str, default: str, choices: tuple[str, ...]) -> str:
    value = environ.get(name, default).strip().lower()
    if value not in choices:
        raise ValueError(f"{name} must be {' or '.join(choices)}, got {value!r}")
    return value


def bind_threads_from_env(environ=os.environ) -> bool:
    """``MODELPLANE_VLLM_BIND_THREADS``: true (the default) or false; anything else is an error.

    >>> bind_threads_from_env({}), bind_threads_from_env({"MODELPLANE_VLLM_BIND_THREADS": "false"})
    (True, False)
    """
    return _choice(environ, "MODELPLANE_VLLM_BIND_THREADS", "true", ("true", "false", "1", "0")) in ("true", "1")


def cpu_executor_from_env(environ=os.environ) -> str:
    """``MODELPLANE_VLLM_CPU_EXECUTOR``: "uni" (the default) or "mp"; anything else is an error.

    >>> cpu_executor_from_env({}), cpu_executor_from_env({"MODELPLANE_VLLM_CPU_EXECUTOR": "mp"})
    ('uni', 'mp')
    """
    return _choice(environ, "MODELPLANE_VLLM_CPU_EXECUTOR", "uni", CPU_EXECUTORS)


def cpu_engine_start_from_env(environ=os.environ) -> str:
    """``MODELPLANE_VLLM_CPU_ENGINE_START``: "auto" (the default), "fork" or "spawn".

    >>> cpu_engine_start_from_env({}), cpu_engine_start_from_env({"MODELPLANE_VLLM_CPU_ENGINE_START": "Spawn"})
    ('auto', 'spawn')
    >>> cpu_engine_start_from_env({"MODELPLANE_VLLM_CPU_ENGINE_START": "forkserver"})
    Traceback (most recent call last):
    ...
    ValueError: MODELPLANE_VLLM_CPU_ENGINE_START must be auto or fork or spawn, got 'forkserver'
    """
    return _choice(environ, "MODELPLANE_VLLM_CPU_ENGINE_START", "auto", CPU_ENGINE_STARTS)


def engine_start(setting: str, executor: str) -> str:
    """The start method a CPU replica's engine core gets: "auto" is fork with "uni", spawn with "mp".

    "fork" with "mp" is refused: vLLM's worker process must then be spawned (it loads its OpenMP
    runtime and binds its threads before anything else starts them), and the engine core that
    starts it would be forked with the same setting.

    >>> engine_start("auto", "uni"), engine_start("auto", "mp"), engine_start("spawn", "uni")
    ('fork', 'spawn', 'spawn')
    >>> engine_start("fork", "mp")
    Traceback (most recent call last):
    ...
    ValueError: cpu_engine_start fork needs cpu_executor uni: with mp, vLLM spawns its worker and its engine core
    """
    if setting not in CPU_ENGINE_STARTS:
        raise ValueError(f"cpu_engine_start must be one of {', '.join(CPU_ENGINE_STARTS)}, got {setting!r}")
    if setting == "fork" and executor != "uni":
        raise ValueError("cpu_engine_start fork needs cpu_executor uni: "
                         "with mp, vLLM spawns its worker and its engine core")
    if setting == "auto":
        return "fork" if executor == "uni" else "spawn"
    return setting
