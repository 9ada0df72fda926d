"""Will the replicas a spec asks for fit where they run?

On one machine the hard limit is memory: every replica holds its weights, its processes and
(vLLM) at least 1 GiB of KV cache, and replicas share the CPUs. The estimate per replica:

- vLLM: weights + (API servers + engine core) × 1 GiB + 1 GiB of KV cache (vLLM's smallest);
- pyfunc: workers × (weights + 0.25 GiB for the interpreter, MLflow and the flavor's libraries).

``served_endpoint`` refuses a rollout whose ``min_replicas`` do not fit, naming the largest count
that does, and records ``max_replicas_that_fit`` beside the revision: the autoscaler stops there
even when ``scaling.max_replicas`` is higher. The estimate is a floor, not a promise: a replica's
KV cache grows into the memory that is free when it starts (``serving.runtime.vllm_runtime``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
VLLM_PROCESS_GIB = 1.0  # serving.runtime.vllm_runtime.PROCESS_OVERHEAD_GIB
VLLM_MIN_KV_GIB = 1.0
PYFUNC_PROCESS_GIB = 0.25
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.gguf", "*.pkl", "*.joblib", "*.onnx", "*.json", "*.ubj")


class CapacityError(ValueError):
    """The replicas asked for do not fit; the message says how many do and what to change."""


@dataclass(frozen=True)
class Capacity:
    memory_bytes: int  # what replicas may use in all: the machine's memory or cgroup limit
    where: str  # for messages: "this machine"


def replica_memory_bytes(runtime: str, weights_bytes: int, options: dict) -> int:
    """The least memory one replica needs (see the module docstring).

    >>> replica_memory_bytes("vllm", GIB // 4, {"api_server_count": 1}) / GIB
    3.25
    >>> replica_memory_bytes("pyfunc", GIB // 4, {"workers": 2}) / GIB
    1.0
    >>> replica_memory_bytes("pyfunc", GIB // 4, {"workers": 1, "memory_gib": 2}) / GIB  # what the spec reserves
    2.0
    """
    if runtime == "vllm":
        processes = int(options.get("api_server_count", 1)) + 1
        least = weights_bytes + int((processes * VLLM_PROCESS_GIB + VLLM_MIN_KV_GIB) * GIB)
    elif runtime == "pyfunc":
        least = int(options.get("workers", 1)) * (weights_bytes + int(PYFUNC_PROCESS_GIB * GIB))
    else:
        raise ValueError(f"unknown runtime {runtime!r}")
    if options.get("memory_gib") is None:
        return least
    asked = int(float(options["memory_gib"]) * GIB)
    if asked < least:
        raise CapacityError(f"replica.memory_gib {options['memory_gib']:g} is below the {least / GIB:.2f} GiB a "
                            f"{runtime} replica of this model needs at least; raise it or leave it unset")
    return asked


def replicas_that_fit(per_replica_bytes: int, capacity: Capacity) -> int:
    """How many such replicas the capacity holds.

    >>> replicas_that_fit(3 * GIB, Capacity(24 * GIB, "this machine"))
    8
    """
    return max(0, math.floor(capacity.memory_bytes / max(1, per_replica_bytes)))


def check_min_replicas(endpoint: str, min_replicas: int, per_replica_bytes: int, capacity: Capacity) -> int:
    """Raise :class:`CapacityError` when ``min_replicas`` do not fit; return how many do fit."""
    fit = replicas_that_fit(per_replica_bytes, capacity)
    if min_replicas > fit:
        need = min_replicas * per_replica_bytes / GIB
        advice = (f"lower scaling.min_replicas to at most {fit}" if fit else
                  "not even one replica fits: serve it where there is more memory")
        raise CapacityError(f"{endpoint}: {min_replicas} replicas need at least {need:.1f} GiB "
                            f"({per_replica_bytes / GIB:.2f} GiB each) and {capacity.where} has "
                            f"{capacity.memory_bytes / GIB:.1f} GiB; {advice}")
    return fit


def model_bytes(model_dir: Path) -> int:
    """Bytes of the files a replica loads from ``model_dir`` (weights and their metadata)."""
    return sum(p.stat().st_size for pattern in WEIGHT_FILES for p in model_dir.rglob(pattern) if p.is_file())


def _meminfo_total(meminfo: Path) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no MemTotal in {meminfo}")


def _cgroup_memory_max(cgroup: Path) -> int | None:
    for path in (cgroup / "memory.max", cgroup / "memory" / "memory.limit_in_bytes"):
        if path.is_file():
            text = path.read_text().strip()
            return None if text == "max" or int(text) >= 1 << 60 else int(text)
    return None


def local_capacity(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> Capacity:
    """This machine: its memory, or the cgroup's limit where that is lower."""
    total = _meminfo_total(meminfo)
    limit = _cgroup_memory_max(cgroup)
    memory = total if limit is None else min(total, limit)
    return Capacity(memory, "this machine")
