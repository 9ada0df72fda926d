"""modelplane's scoring server for classic MLflow models (pyfunc), and its replica adapter.

It replaces ``mlflow models serve`` inside a replica: the same ``POST /invocations`` protocol
(``dataframe_split``, ``dataframe_records``, ``instances``, ``inputs``, optional ``params``),
with dynamic micro-batching, Prometheus metrics and a readiness-aware ``/health``.

Modules, from pure to I/O:

- ``config``: the typed server config and the thread-count formula.
- ``payload``: request bytes → :class:`~.payload.Invocation` or an error with a status (pure).
- ``batching``: which queued requests share one ``predict`` call, and for how long to wait (pure).
- ``predictor``: the MLflow model: schema enforcement, batched predict with per-request fallback.
- ``batcher``: the asyncio queue that applies ``batching`` and runs predict in a worker thread.
- ``metrics``: Prometheus metrics, correct across worker processes.
- ``app``: the raw ASGI application (no framework on the hot path).
- ``server``: uvicorn, sockets and the worker-process supervisor; ``__main__`` is the CLI.
- ``runtime``: :class:`PyfuncRuntime`, the ``ReplicaRuntime`` the cluster backend uses.

Importing this package is cheap (no MLflow, no pandas): the supervisor only needs ``runtime``.
"""

from serving.runtime.pyfunc.runtime import PyfuncRuntime

__all__ = ["PyfuncRuntime"]
