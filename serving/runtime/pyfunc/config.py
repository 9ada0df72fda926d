"""The scoring server's typed configuration, and how many compute threads each worker gets.

Defaults live here and only here; the CLI (``__main__``) and :class:`~.runtime.PyfuncRuntime`
both build a :class:`PyfuncServerConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from serving.runtime.cpu import threads_for

DEFAULT_MAX_BATCH_ROWS = 64
DEFAULT_MAX_BATCH_WAIT_MS = 2.0
DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # 8 MiB

# Every thread pool a numeric library may start on import; each must be set before that import.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                   "VECLIB_MAXIMUM_THREADS")


@dataclass(frozen=True)
class PyfuncServerConfig:
    """One replica's scoring server.

    ``max_batch_rows`` caps the *rows* of one ``predict`` call (the batching unit is rows, not
    requests: predict time grows with rows, so a row cap bounds the latency a batch adds). A
    single request larger than the cap still runs, alone.
    """

    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 1  # server processes sharing the port (SO_REUSEPORT)
    max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS
    max_batch_wait_ms: float = DEFAULT_MAX_BATCH_WAIT_MS  # longest a request waits for company
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies get 413

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.port < 65536:
            problems.append(f"port must be 1..65535, got {self.port}")
        if self.workers < 1:
            problems.append(f"workers must be ≥ 1, got {self.workers}")
        if self.max_batch_rows < 1:
            problems.append(f"max_batch_rows must be ≥ 1, got {self.max_batch_rows}")
        if not 0 <= self.max_batch_wait_ms <= 1000:
            problems.append(f"max_batch_wait_ms must be within 0..1000, got {self.max_batch_wait_ms}")
        if self.max_body_bytes < 1:
            problems.append(f"max_body_bytes must be ≥ 1, got {self.max_body_bytes}")
        if problems:
            raise ValueError("invalid pyfunc server config: " + "; ".join(problems))


def threads_per_worker(cpus: float, workers: int) -> int:
    """Compute threads for each of ``workers`` processes sharing a ``cpus`` budget.

    Worked examples: 8 CPUs, 3 workers → floor(8 / 3) = 2 threads each (6 busy CPUs, never 9);
    1.5 CPUs, 2 workers → floor(0.75) → at least 1 thread each.

    >>> threads_per_worker(8, 3)
    2
    >>> threads_per_worker(1.5, 2)
    1
    """
    return threads_for(cpus / max(1, workers))


def thread_env(cpus: float, workers: int) -> dict[str, str]:
    """The environment that caps OpenMP/MKL/OpenBLAS thread pools at :func:`threads_per_worker`."""
    threads = str(threads_per_worker(cpus, workers))
    return {name: threads for name in THREAD_ENV_VARS}
