"""What the cluster backend needs from a replica runtime: one narrow Protocol.

A runtime turns a model directory into a server process (``command``), says how to ask it
the smallest possible question (``probe_request``, used for warm-up and for liveness when
nothing completed recently) and reads forward progress from its Prometheus ``/metrics``
text (``progress``). The supervisor does the rest: start, wait for ``GET /health``, send
the probe (readiness = model loaded and one request answered), and watch progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class ReplicaLaunch:
    """How to start one replica process."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment


@dataclass(frozen=True)
class ProbeRequest:
    """A minimal request: POST ``json`` to ``path``; any 2xx answer means the replica works."""

    path: str
    json: dict


@dataclass(frozen=True)
class Progress:
    """Counters read from one scrape of ``/metrics``."""

    completed_total: float  # requests finished since the process started (monotonic)
    in_flight: float  # requests being worked on now
    queued: float  # requests accepted but waiting
    # A counter that moves while work is being done, before any request completes (vLLM:
    # prompt + generated tokens); 0 where the runtime has none (pyfunc predicts whole batches).
    work_total: float = 0.0


@dataclass(frozen=True)
class RuntimeConfig:
    """Per-replica runtime settings (from the endpoint spec and the hardware)."""

    model_name: str  # the name clients use (the endpoint name)
    cpu_cores: float | None = None  # None = read the cgroup quota of this machine
    api_server_count: int = 1  # vLLM front-end processes
    workers: int = 1  # pyfunc worker processes
    max_batch_size: int = 64  # pyfunc micro-batching
    max_batch_wait_ms: float = 2.0  # pyfunc micro-batching
    memory_gib: float | None = None  # the replica's memory (capacity checks; Kubernetes: request and limit)
    gpus: int = 0  # GPUs per replica (Kubernetes: nvidia.com/gpu)


class ReplicaRuntime(Protocol):
    name: str  # "vllm" or "pyfunc"

    def command(self, model_dir: Path, host: str, port: int, config: RuntimeConfig) -> ReplicaLaunch: ...

    def probe_request(self, model_dir: Path, config: RuntimeConfig) -> ProbeRequest | None:
        """A request the model answers (warm-up, liveness); None when nothing says what it takes
        (a model logged with neither an input example nor a signature): it is then ready once its
        ``/health`` says the model is loaded, and an idle one is alive while ``/metrics`` answers."""

    def progress(self, metrics_text: str) -> Progress: ...
