"""Runtimes by name, as revisions record them ("vllm", "pyfunc")."""

from __future__ import annotations

from serving.runtime.base import ReplicaRuntime


def runtime_for(name: str) -> ReplicaRuntime:
    if name == "vllm":
        from serving.runtime.vllm_runtime import VllmRuntime

        return VllmRuntime()
    if name == "pyfunc":
        from serving.runtime.pyfunc import PyfuncRuntime

        return PyfuncRuntime()
    raise KeyError(f"unknown runtime {name!r}; known: vllm, pyfunc")
