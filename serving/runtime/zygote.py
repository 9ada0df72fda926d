"""A runtime process started ahead of need: interpreter up, engine imported, no model, waiting for a replica.

``python -m serving.runtime.zygote --kind vllm --control fd:5 [--preload m1,m2] [--preload-log PATH]``
imports what a replica of that kind imports before it reads its arguments,
says ``ready`` on the control channel (a socket: an inherited fd, or ``unix:PATH``) and
blocks until one assignment arrives: the replica's argv (``[python, "-m", module, *args]``),
its complete environment, cwd and log path. It then becomes that replica: environment
replaced, stdout/stderr on the log (after what the imports printed), stdin ``/dev/null``,
CPU affinity of the assigner, ``sys.argv`` set, ``runpy.run_module(module, "__main__")``, and
its exit status is the replica's. :mod:`cluster.local.warm_pool` keeps these per runtime kind.

What it saves is the replica process's own imports: for vLLM's API server about 11 s here
(SmolLM2, first answered inference 40.2 s cold → 29.2 s warm, medians of 3 alternating
repeats; the zygote's own import took 9.6-13.3 s beforehand), for the pyfunc server about 2 s.
vLLM on CPU starts its engine core (and, with the ``mp`` executor, a worker) with the ``spawn`` method
(``vllm/platforms/cpu.py`` sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``
whatever the environment says, because each worker must load PyTorch's libgomp through
``LD_PRELOAD`` and bind its OpenMP threads before anything else starts them), unless the
replica's engine core is forked (``VllmSettings.cpu_engine_start``, the default with the ``uni``
executor, :mod:`serving.runtime.vllm_plugin`): it then shares the zygote's imports too, and a
warm SmolLM2 replica answers its first inference in about 9 s instead of 22 cold
(``benchmarks/engine_startup.py``, docs/benchmarks.md).

An assignment is refused, before anything changes, when the replica would not be the one a
cold ``Popen`` of the same argv and environment starts (:func:`refusal`): another python, an
interpreter option, a module this kind does not serve, another cwd (``sys.path[0]``), or an
environment variable read at import time that has another value. "Read at import time" is
(a) every variable a preloaded module looked up by name (``os.environ[...]``, ``.get``,
``in``, ``os.getenv``), recorded with its value or its absence while the preload ran (full
scans such as ``dict(os.environ)`` are not counted: wsgiref's snapshot, tqdm's and networkx's
prefix scans), and (b) :data:`NATIVE_ENV_PREFIXES`, what the interpreter reads at start-up and
native libraries read when they load (OpenMP, BLAS and oneDNN thread pools, the dynamic
loader, malloc, locale), which no Python hook sees. ``OMP_NUM_THREADS`` is therefore never
"applied" to a zygote that loaded libgomp under another value (``torch.set_num_threads`` would
change the calling thread only): such an assignment is refused and the replica starts cold.
Lazily read settings (``vllm.envs``: ``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``,
``VLLM_HOST_IP``) are not read by the imports and may differ. What the imports wrote into the
environment (vLLM's: ``KMP_INIT_AT_FORK``, ``TORCHINDUCTOR_COMPILE_THREADS``, cv2's
``LD_LIBRARY_PATH`` …) is written again over the assignment's, as the cold process's own
imports would have, so the engine core and worker it spawns inherit the same environment.
Where the interpreter coerces a C locale (no ``LANG``), it sets ``LC_CTYPE`` in the zygote's
environment, and every assignment without it is refused: such replicas start cold.

Visible differences from a cold process: ``/proc/PID/cmdline`` is the replica's argv written
with ``setproctitle`` (one string, which ``psutil`` splits on spaces, so the supervisor's
adoption still finds the port among its tokens), ``/proc/PID/environ`` is overwritten by that
title, and ``process_start_time_seconds`` in ``/metrics`` is the zygote's start.

This module imports nothing outside the standard library at load: it must run under any
python a replica may use.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import socket
import sys
import time
from dataclasses import asdict, dataclass, field

from serving.runtime.env_reads import EnvReads

# Read by the interpreter at start-up or by native code when a library loads: a zygote cannot
# take another value of these once its imports ran (prefix match, case-sensitive).
NATIVE_ENV_PREFIXES = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_", "NUMEXPR_",
                       "VECLIB_", "ONEDNN_", "DNNL_", "MALLOC_", "GLIBC_TUNABLES", "LC_", "LANG", "TZ", "TORCH_",
                       "ATEN_", "CUDA_", "HIP_", "NCCL_")
# The zygote's own ``--preload`` and ``--serves`` per runtime kind.
# serving.runtime.pyfunc.config.THREAD_ENV_VARS: main() sets them from --workers when absent.
PYFUNC_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                     "VECLIB_MAXIMUM_THREADS")
PYFUNC_PRE_IMPORT_ENV = {  # what ``serving.runtime.pyfunc.__main__.main`` sets (setdefault) before MLflow is imported
    "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1", "_MLFLOW_IS_IN_SERVING_ENVIRONMENT": "true"}


@dataclass(frozen=True)
class ZygoteKind:
    """What one runtime kind runs (``serves``: the modules of ``python -m``) and imports ahead.

    ``pre_import_env`` is set with ``setdefault`` before the preload, as the runtime's own
    ``main`` sets it before its heavy imports, so that a module reads at import what it
    would read in a cold process.
    """

    serves: tuple[str, ...]
    preload: tuple[str, ...]
    pre_import_env: dict[str, str] = field(default_factory=dict)
    # Variables the runtime's main derives from its arguments when they are absent, after some
    # preloaded library read them: an assignment must set them itself.
    required_env: tuple[str, ...] = ()


KINDS = {
    # Everything `python -m vllm.entrypoints.openai.api_server` imports before main() parses its
    # arguments; main's later imports read VLLM_WORKER_MULTIPROC_METHOD after cli_env_setup and are
    # left to the replica.
    "vllm": ZygoteKind(serves=("vllm.entrypoints.openai.api_server",),
                       preload=("vllm.entrypoints.openai.api_server",)),
    # __main__ itself, then what main() imports once it has set its environment defaults.
    "pyfunc": ZygoteKind(serves=("serving.runtime.pyfunc",),
                         preload=("serving.runtime.pyfunc.__main__", "serving.runtime.pyfunc.server", "mlflow.pyfunc"),
                         pre_import_env=PYFUNC_PRE_IMPORT_ENV, required_env=PYFUNC_THREAD_ENV),
}


@dataclass(frozen=True)
class ZygoteFacts:
    """What a ready zygote reports: enough to decide, without it, whether an assignment fits."""

    pid: int
    kind: str
    python: str  # sys.executable: the path it was started with (a venv's python is not resolved)
    cwd: str  # sys.path[0], as `python -m` sets it
    serves: tuple[str, ...]
    pre_import_env: dict[str, str]
    import_env: dict[str, str | None]  # name -> the zygote's value when its imports ran (None: absent)
    import_writes: dict[str, str | None]  # what the imports set (None: removed), replayed on assignment
    preload_s: float
    required_env: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: dict) -> ZygoteFacts:
        return cls(pid=data["pid"], kind=data["kind"], python=data["python"], cwd=data["cwd"],
                   serves=tuple(data["serves"]), pre_import_env=dict(data["pre_import_env"]),
                   import_env=dict(data["import_env"]), import_writes=dict(data["import_writes"]),
                   preload_s=data["preload_s"], required_env=tuple(data.get("required_env", ())))


@dataclass(frozen=True)
class Assignment:
    """One replica for a zygote to become; ``env`` is complete (not added to the zygote's)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    log_path: str
    cpu_affinity: list[int] | None = None  # what a cold child would inherit from the assigner

    @classmethod
    def from_json(cls, data: dict) -> Assignment:
        return cls(argv=list(data["argv"]), env=dict(data["env"]), cwd=data["cwd"], log_path=data["log_path"],
                   cpu_affinity=data.get("cpu_affinity"))


def native_env(name: str) -> bool:
    """Whether ``name`` is read by the interpreter or by native code at load (:data:`NATIVE_ENV_PREFIXES`).

    >>> native_env("OMP_NUM_THREADS"), native_env("VLLM_CPU_KVCACHE_SPACE")
    (True, False)
    """
    return name.startswith(NATIVE_ENV_PREFIXES)


def import_env_snapshot(start_env: dict[str, str], read: set[str], written: set[str]) -> dict[str, str | None]:
    """The variables an assignment must match, with the values the zygote started with.

    Those the imports read by name or wrote (a cold process starting from another value could
    have read or written something else), plus the native ones present.

    >>> import_env_snapshot({"OMP_NUM_THREADS": "2", "HOME": "/root", "X": "1"}, {"HOME", "Y"}, {"Z"})
    {'OMP_NUM_THREADS': '2', 'HOME': '/root', 'Y': None, 'Z': None}
    """
    return {**{k: v for k, v in start_env.items() if native_env(k)},
            **{k: start_env.get(k) for k in sorted(read | written)}}


def env_writes(before: dict[str, str], after: dict[str, str]) -> dict[str, str | None]:
    """What changed in the environment: new values, None for removed names.

    >>> env_writes({"A": "1", "B": "2"}, {"A": "1", "B": "3", "C": "4"}), env_writes({"A": "1"}, {})
    ({'B': '3', 'C': '4'}, {'A': None})
    """
    return {**{k: v for k, v in after.items() if before.get(k) != v}, **{k: None for k in before if k not in after}}


def refusal(assignment: Assignment, facts: ZygoteFacts) -> str | None:
    """Why this zygote cannot become ``assignment`` exactly as a cold process would; None when it can.

    >>> facts = ZygoteFacts(1, "demo", "/venv/bin/python", "/srv", ("http.server",), {},
    ...                     {"OMP_NUM_THREADS": "2"}, {}, 0.1)
    >>> ok = Assignment(["/venv/bin/python", "-m", "http.server", "8000"], {"OMP_NUM_THREADS": "2", "X": "1"},
    ...                 "/srv", "l")
    >>> refusal(ok, facts) is None
    True
    >>> refusal(Assignment(["/other/python", "-m", "http.server"], ok.env, "/srv", "l"), facts)
    "python /other/python is not the zygote's /venv/bin/python"
    >>> refusal(Assignment(ok.argv, {"OMP_NUM_THREADS": "4"}, "/srv", "l"), facts)
    'environment read at import differs from the zygote: OMP_NUM_THREADS'
    """
    argv = assignment.argv
    if len(argv) < 3 or argv[1] != "-m":
        return f"argv must be [python, '-m', module, ...], got {argv[:3]}"
    if os.path.abspath(argv[0]) != facts.python:
        return f"python {argv[0]} is not the zygote's {facts.python}"
    if argv[2] not in facts.serves:
        return f"module {argv[2]} is not served by a {facts.kind} zygote ({', '.join(facts.serves)})"
    if os.path.abspath(assignment.cwd) != facts.cwd:
        return f"cwd {assignment.cwd} is not the zygote's {facts.cwd} (sys.path[0] would differ)"
    if missing := [k for k in facts.required_env if k not in assignment.env]:
        return f"a {facts.kind} assignment must set {', '.join(missing)} (its main would derive them after import)"
    effective = {**facts.pre_import_env, **assignment.env}  # as main()'s setdefault leaves it
    names = set(facts.import_env) | {k for k in effective if native_env(k)}
    differing = sorted(k for k in names if effective.get(k) != facts.import_env.get(k))
    if differing:  # names only: a value may be a secret
        shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
        return f"environment read at import differs from the zygote: {shown}"
    return None


# ---- the process ---------------------------------------------------------------------------

def _open_control(spec: str) -> socket.socket:
    if spec.startswith("fd:") or spec.isdigit():
        return socket.socket(fileno=int(spec.removeprefix("fd:")))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(spec.removeprefix("unix:"))
    return sock


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _receive(sock: socket.socket) -> dict | None:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1 << 20)
        if not chunk:
            return None  # the pool went away: nothing to become
        data += chunk
    return json.loads(data)


def preload(kind: ZygoteKind, modules: tuple[str, ...]) -> tuple[dict[str, str], set[str], dict[str, str | None]]:
    """Import ``modules`` under the kind's pre-import defaults.

    Returns the environment they started from, the names they read, and what they wrote.
    """
    for name, value in kind.pre_import_env.items():
        os.environ.setdefault(name, value)
    start_env = dict(os.environ)
    with EnvReads() as spy:
        for module in modules:
            importlib.import_module(module)
    # The modules to run are executed afresh as __main__; left in sys.modules, runpy would warn
    # and a cold process never has them under their own names.
    for served in kind.serves:
        for name in (served, f"{served}.__main__"):
            if sys.modules.pop(name, None) is not None:
                parent, _, attr = name.rpartition(".")
                if parent in sys.modules and getattr(sys.modules[parent], attr, None) is not None:
                    delattr(sys.modules[parent], attr)
    return start_env, set(spy.reads), env_writes(start_env, dict(os.environ))


def _retitle(argv: list[str]) -> None:
    """Show the replica's argv in ``ps`` and ``/proc/PID/cmdline`` (supervisor adoption looks for its port there)."""
    try:
        import setproctitle  # vLLM's own dependency; without it ps shows the zygote's argv
    except ImportError:
        return
    # Padding past the title buffer keeps the kernel from showing NUL-separated leftovers, so
    # psutil.cmdline() splits the title on spaces and the port is one of its tokens.
    setproctitle.setproctitle(" ".join(argv) + " " * 65536)


def become(assignment: Assignment, import_writes: dict[str, str | None], preload_log: str | None) -> None:
    """Turn this process into the assigned replica, then run it (returns when its module does).

    ``import_writes`` are replayed over the assignment's environment: a cold process would
    have made the same writes when it imported the same modules from the same values.
    """
    _retitle(assignment.argv)  # first: setproctitle finds the argv area through the untouched environment
    sys.stdout.flush()
    sys.stderr.flush()
    log_fd = os.open(assignment.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if preload_log and os.path.isfile(preload_log):
        with open(preload_log, "rb") as earlier:  # what the imports printed, as a cold process would have
            os.write(log_fd, earlier.read())
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()  # through unsetenv/putenv: children and C code see the replica's environment
    os.environ.update(assignment.env)  # (os.environb shares os.environ's data)
    for name, value in import_writes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.chdir(assignment.cwd)
    sys.path[0] = os.getcwd()
    if assignment.cpu_affinity and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, assignment.cpu_affinity)
    sys.argv = [assignment.argv[0], *assignment.argv[3:]]  # run_module puts the module's file in argv[0]
    sys.orig_argv = list(assignment.argv)
    runpy.run_module(assignment.argv[2], run_name="__main__", alter_sys=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m serving.runtime.zygote", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", required=True, help=f"runtime kind: {', '.join(KINDS)} or a name with --serves")
    parser.add_argument("--control", required=True, help="fd:N (an inherited socket) or unix:PATH")
    parser.add_argument("--preload", default=None, help="comma-separated modules (default: the kind's)")
    parser.add_argument("--serves", default=None,
                        help="comma-separated modules a replica may run (default: the kind's)")
    parser.add_argument("--preload-log", default=None, help="where this process's output goes until assigned")
    args = parser.parse_args(argv)
    if args.kind not in KINDS and not args.serves:
        parser.error(f"unknown kind {args.kind!r}: pass --serves (and --preload)")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    sys.path[0] = os.getcwd()  # as `python -m` sets it, also when started by file path
    known = KINDS.get(args.kind, ZygoteKind(serves=(), preload=()))
    kind = ZygoteKind(serves=tuple(args.serves.split(",")) if args.serves else known.serves,
                      preload=(tuple(filter(None, args.preload.split(","))) if args.preload is not None
                               else known.preload),
                      pre_import_env=known.pre_import_env, required_env=known.required_env)
    control = _open_control(args.control)
    start_env, read, writes = preload(kind, kind.preload)
    facts = ZygoteFacts(pid=os.getpid(), kind=args.kind, python=sys.executable, cwd=os.getcwd(), serves=kind.serves,
                        pre_import_env=kind.pre_import_env,
                        import_env=import_env_snapshot(start_env, read, set(writes)), import_writes=writes,
                        preload_s=round(time.monotonic() - started, 3), required_env=kind.required_env)
    _send(control, {"event": "ready", **asdict(facts)})
    message = _receive(control)
    if message is None:
        return 0
    assignment = Assignment.from_json(message)
    reason = refusal(assignment, facts)
    _send(control, {"event": "refused", "reason": reason} if reason else {"event": "accepted"})
    control.close()
    if reason:
        return 3
    become(assignment, facts.import_writes, args.preload_log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
