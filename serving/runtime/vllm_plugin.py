"""A vLLM general plugin that prepares each vLLM process for this CPU before its kernels run.

vLLM calls every entry point of the group ``vllm.general_plugins`` once in each of its
processes: the API server (``EngineArgs``), the engine core (``EngineCore.__init__``) and
every worker (``WorkerWrapperBase.init_worker``), before a model is built
(``vllm/plugins/__init__.py``). modelplane registers :func:`prepare_process` there
(``pyproject.toml``), which asks Linux for AMX tile state where the CPU has AMX
(:mod:`serving.runtime.amx`) and, where that is refused or ``MODELPLANE_AMX=off``, makes
``torch.cpu._is_amx_tile_supported()`` answer False in that process: vLLM chooses its AMX
attention and its AMX INT8/bf16 GEMMs by that call alone, so it then runs its AVX-512
kernels.

Why a plugin: it runs in exactly the processes that run vLLM, however they were started
(a replica, the eval gate's engines, the cost sweep's replica, a benchmark's plain vLLM
server in this environment) and whatever start method vLLM uses for its workers, and it
leaves every other Python process alone. A ``sitecustomize`` on ``PYTHONPATH`` would run
in every interpreter the supervisor starts and would be lost the moment a replica's
environment set its own ``PYTHONPATH``; a wrapper script would not reach the workers vLLM
spawns. vLLM does not catch a plugin's exceptions, so this one never raises.

Where the replica's environment says ``MODELPLANE_VLLM_ENGINE_START=fork`` (set by
:class:`serving.runtime.vllm_runtime.VllmRuntime` on CPU with the ``uni`` executor,
``VllmSettings.cpu_engine_start``), the plugin also has vLLM fork its engine core from the API
server instead of spawning it: vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``
in ``check_and_update_config`` whatever the environment says, so that a worker process can
load its OpenMP runtime and bind its threads first; with the ``uni`` executor there is no
worker, the API server has run no OpenMP region yet when it starts the engine core, and the
binding (``OMP_PLACES``) is in the replica's environment from the start. The engine core then
shares the API server's imports instead of importing torch and vLLM again: a tiny Llama is
healthy in about 17 s instead of 26 on 2 cores of a Xeon, with 9 CPU-seconds less, at the
same tokens/s (docs/benchmarks.md). AMX permission is inherited across ``fork``.

Each process writes one line to its log (the replica log), e.g.
``modelplane-amx pid=4242 status=granted xcomp_perm=0x602e7: AMX tile data permitted …``
with the permission mask read back by ``arch_prctl(ARCH_GET_XCOMP_PERM)``.
"""

from __future__ import annotations

import os
import sys

from serving.runtime import amx

ENTRY_POINT_NAME = "modelplane_cpu"  # the name in pyproject.toml, for VLLM_PLUGINS allow-lists
ENGINE_START_ENV = "MODELPLANE_VLLM_ENGINE_START"  # VllmRuntime.command sets it in a replica's environment


def disable_amx_kernels() -> None:
    """Make this process's vLLM see a CPU without AMX (and cap oneDNN below AMX for what starts later)."""
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False
    torch.cpu._is_amx_fp16_supported = lambda: False
    os.environ.setdefault(amx.ONEDNN_ISA_ENV, amx.ONEDNN_ISA_WITHOUT_AMX)


def prepare_process() -> amx.AmxState:
    """Request AMX state in this process or keep vLLM off AMX; log what happened. Never raises."""
    try:
        import torch

        cpu_has_amx = bool(torch.cpu._is_amx_tile_supported())  # the very check vLLM chooses kernels by
        try:
            mode = amx.mode_from_env()
        except ValueError as exc:
            state = amx.AmxState("disabled", f"{exc}; running without AMX kernels")
        else:
            state = amx.prepare(cpu_has_amx, mode, amx.linux_permission())
        if cpu_has_amx and not state.usable:
            disable_amx_kernels()
    except Exception as exc:  # noqa: BLE001 - a plugin that raises takes vLLM down with it
        state = amx.AmxState("refused", f"preparing the CPU failed ({type(exc).__name__}: {exc}); "
                                        "running without AMX kernels")
        try:
            disable_amx_kernels()
        except Exception:  # noqa: BLE001
            pass
    print(state.log_line(os.getpid()), file=sys.stderr, flush=True)
    if os.environ.get(ENGINE_START_ENV) == "fork":
        try:
            fork_engine_core(state)
        except Exception as exc:  # noqa: BLE001 - vLLM then spawns it, as it would without the setting
            print(f"modelplane-engine-start pid={os.getpid()}: not forking the engine core "
                  f"({type(exc).__name__}: {exc}); vLLM spawns it", file=sys.stderr, flush=True)
    return state


def fork_engine_core(state: amx.AmxState) -> None:
    """Have vLLM's CPU platform leave its start method at ``fork``, and have every process forked
    from this one write its own AMX line (the state it inherited, read back)."""
    from vllm.platforms import cpu

    original = cpu.CpuPlatform.__dict__["check_and_update_config"].__func__
    if getattr(original, "keeps_fork", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    check_and_update_config.keeps_fork = True
    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    parent = os.getpid()
    os.register_at_fork(after_in_child=lambda: _log_inherited(state, parent))


def _log_inherited(state: amx.AmxState, parent: int) -> None:
    try:
        permission = amx.linux_permission()
        mask = permission.permitted_mask() if permission is not None else None
    except OSError:
        mask = None
    inherited = amx.AmxState(state.status, f"{state.detail} (inherited: forked from pid {parent})", mask)
    print(inherited.log_line(os.getpid()), file=sys.stderr, flush=True)
