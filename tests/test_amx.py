"""AMX tile state: the decision (pure, on the fake kernel), the real kernel's answer on this CPU,
the vLLM plugin that keeps an engine off AMX kernels when Linux refuses, and the hardware profile."""

from __future__ import annotations

import errno

import pytest

from cluster.hardware import HardwareProfile, cpu_isa, isa_level, probe_amx
from serving.runtime import amx, vllm_plugin
from serving.runtime.amx import FakeXcompPermission, prepare, tile_data_permitted


def this_cpu_has_amx() -> bool:
    return "amx_tile" in cpu_isa()


# ---- the decision -------------------------------------------------------------------------------

@pytest.mark.parametrize("cpu_has_amx, mode, kernel, status, requested", [
    (False, "auto", FakeXcompPermission(amx=False), "absent", []),  # AMD: nothing is asked
    (False, "off", FakeXcompPermission(amx=False), "absent", []),
    (True, "auto", FakeXcompPermission(amx=True), "granted", [amx.XFEATURE_XTILEDATA]),
    (True, "off", FakeXcompPermission(amx=True), "disabled", []),  # off: never asked, never used
    (True, "auto", FakeXcompPermission(amx=True, refuse_errno=errno.ENOSPC), "refused", [18]),  # small sigaltstack
    (True, "auto", FakeXcompPermission(amx=False), "refused", [18]),  # CPUID says AMX, the kernel has no XFD
    (True, "auto", None, "refused", []),  # no arch_prctl on this platform
])
def test_prepare_asks_only_where_the_cpu_has_amx_and_reports_what_came_of_it(cpu_has_amx, mode, kernel, status,
                                                                           requested):
    state = prepare(cpu_has_amx, mode, kernel)
    assert state.status == status
    assert state.usable is (status == "granted")
    if kernel is not None:
        assert kernel.requests == requested
        assert tile_data_permitted(state.permitted_mask) is (status == "granted")


def test_a_refusal_names_the_errno_and_what_happens_instead():
    state = prepare(True, "auto", FakeXcompPermission(amx=True, refuse_errno=errno.ENOSPC))
    assert "ENOSPC" in state.detail and "running without AMX kernels" in state.detail


def test_an_accepted_request_that_does_not_read_back_counts_as_refused():
    class Forgetful(FakeXcompPermission):
        def request(self, feature: int) -> int:
            self.requests.append(feature)
            return 0  # says yes, grants nothing

    assert prepare(True, "auto", Forgetful(amx=True)).status == "refused"


def test_an_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="MODELPLANE_AMX must be one of auto, off"):
        prepare(True, "on", FakeXcompPermission(amx=True))


def test_the_log_line_carries_pid_status_and_the_read_back_mask():
    line = prepare(True, "auto", FakeXcompPermission(amx=True)).log_line(4242)
    assert line.startswith("modelplane-amx pid=4242 status=granted xcomp_perm=0x600e7")


# ---- the real kernel on this CPU ------------------------------------------------------------------

def test_a_fresh_process_on_this_machine_gets_amx_state_exactly_where_the_cpu_has_amx():
    """Asked in a throwaway interpreter with the real arch_prctl: granted on AMX Xeons; on other
    CPUs even a forced request is refused and XTILEDATA stays unpermitted."""
    state = probe_amx.__wrapped__(True)  # ask even where the CPU has no AMX: the kernel must say no
    if this_cpu_has_amx():
        assert state.status == "granted", state.detail
        assert tile_data_permitted(state.permitted_mask)
    else:
        assert state.status == "refused", state.detail
        assert state.permitted_mask is not None and not tile_data_permitted(state.permitted_mask)
    assert probe_amx.__wrapped__(False).status == "absent"


# ---- the vLLM plugin ------------------------------------------------------------------------------

@pytest.fixture
def amx_claimed(monkeypatch):
    """torch reports an AMX CPU (as CPUID does on a Xeon); restored after the test."""
    import torch

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: True)
    for name in (amx.MODE_ENV, amx.ONEDNN_ISA_ENV):  # set first, so that teardown restores what was there
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return torch


def vllm_picks_amx() -> bool:
    import torch
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    attention_amx = _get_attn_isa(torch.bfloat16, block_size=128, head_size=64) == "amx"
    return attention_amx or check_cpu_sgl_kernel(1536, 576, torch.int8)


def test_the_plugin_keeps_vllm_off_amx_kernels_when_linux_refuses(amx_claimed, monkeypatch, capsys):
    monkeypatch.setattr(amx, "linux_permission", lambda: FakeXcompPermission(amx=True, refuse_errno=errno.ENOSPC))
    assert vllm_picks_amx()  # what vLLM would run, and die on
    state = vllm_plugin.prepare_process()
    assert state.status == "refused"
    assert not vllm_picks_amx()
    assert "status=refused" in capsys.readouterr().err


def test_the_plugin_leaves_vllm_on_amx_when_linux_grants_it(amx_claimed, monkeypatch):
    monkeypatch.setattr(amx, "linux_permission", lambda: FakeXcompPermission(amx=True))
    assert vllm_plugin.prepare_process().status == "granted"
    assert vllm_picks_amx()


def test_mode_off_keeps_vllm_off_amx_and_asks_nothing(amx_claimed, monkeypatch):
    kernel = FakeXcompPermission(amx=True)
    monkeypatch.setattr(amx, "linux_permission", lambda: kernel)
    monkeypatch.setenv(amx.MODE_ENV, "off")
    assert vllm_plugin.prepare_process().status == "disabled"
    assert kernel.requests == [] and not vllm_picks_amx()


def test_the_plugin_never_raises_into_vllm(amx_claimed, monkeypatch):
    def broken():
        raise RuntimeError("no libc")

    monkeypatch.setattr(amx, "linux_permission", broken)
    state = vllm_plugin.prepare_process()
    assert state.status == "refused" and "RuntimeError: no libc" in state.detail
    assert not vllm_picks_amx()


def test_the_plugin_is_registered_where_vllm_looks_for_it():
    from importlib.metadata import entry_points

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins[vllm_plugin.ENTRY_POINT_NAME] == "serving.runtime.vllm_plugin:prepare_process"


# ---- the hardware profile -------------------------------------------------------------------------

XEON_FLAGS = "fpu avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16"
EPYC_FLAGS = "fpu avx2 avx512f avx512_vnni avx512_bf16 avx512vl"


@pytest.mark.parametrize("flags, expected", [
    (XEON_FLAGS, ("amx_bf16", "amx_int8", "amx_tile", "avx2", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx512f")),
    (EPYC_FLAGS, ("avx2", "avx512_bf16", "avx512_vnni", "avx512f")),
])
def test_the_profile_records_the_cpu_isa_features(tmp_path, flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n")
    assert cpu_isa(cpuinfo) == expected


def test_an_amx_machine_and_an_amd_one_never_share_a_cost_profile_key():
    xeon = ("amx_tile", "avx512_bf16", "avx512f")
    keys = {HardwareProfile("cpu", "Intel Xeon", 2.0, isa=xeon, amx="granted").key,
            HardwareProfile("cpu", "Intel Xeon", 2.0, isa=xeon, amx="refused").key,
            HardwareProfile("cpu", "AMD EPYC", 2.0, isa=("avx512_bf16", "avx512f")).key}
    assert len(keys) == 3


def test_isa_level_is_amx_only_where_linux_grants_it():
    assert isa_level(("amx_tile", "avx512_bf16"), "granted") == "amx"
    assert isa_level(("amx_tile", "avx512_bf16"), "disabled") == "avx512bf16"
    assert isa_level(("avx2",), "absent") == "avx2"


# ---- the real engine, on a CPU that claims AMX and a kernel that refuses it ---------------------

# Imported first by every Python process of the test's engine (PYTHONPATH): torch reports AMX,
# as CPUID does on a Xeon, and the main thread gets a 4 KiB signal stack, too small for the AMX
# signal frame, so Linux refuses XTILEDATA with ENOSPC on an AMX CPU (and with EOPNOTSUPP on
# any other). Without the plugin's fallback vLLM runs its AMX attention here and dies of SIGILL.
REFUSING_SITECUSTOMIZE = '''
import ctypes
import torch

torch.cpu._is_amx_tile_supported = lambda: True


class _Stack(ctypes.Structure):
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


_buffer = ctypes.create_string_buffer(4096)
_stack = _Stack(ctypes.cast(_buffer, ctypes.c_void_p), 0, 4096)
if ctypes.CDLL(None, use_errno=True).sigaltstack(ctypes.byref(_stack), None) != 0:
    raise OSError(ctypes.get_errno(), "sigaltstack")
'''


@pytest.mark.slow
def test_an_engine_that_linux_refuses_amx_answers_on_its_other_kernels_and_says_so(tmp_path, tiny_llama):
    import httpx

    from serving.runtime.amx import amx_log_lines
    from serving.runtime.base import RuntimeConfig
    from serving.runtime.process import free_port, running_server
    from serving.runtime.vllm_runtime import VllmRuntime

    model_dir = tiny_llama(tmp_path / "tiny")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(REFUSING_SITECUSTOMIZE)
    port = free_port()
    launch = VllmRuntime(accelerator="cpu").command(model_dir, "127.0.0.1", port, RuntimeConfig(model_name="tiny"))
    env = {**launch.env, "PYTHONPATH": str(tmp_path / "site")}
    log_path = tmp_path / "engine.log"
    with running_server(launch.argv, env, port, log_path, startup_timeout_s=300) as (base, _):
        response = httpx.post(f"{base}/v1/completions", trust_env=False, timeout=60,
                              json={"model": "tiny", "prompt": "Fix: they goes home.", "max_tokens": 8})
        assert response.status_code == 200, log_path.read_text()[-3000:]
    lines = amx_log_lines(log_path.read_text())
    assert len(lines) >= 2  # API server, engine core (which runs the model: the "uni" executor)
    assert {status for status, _ in lines.values()} == {"refused"}
    assert "running without AMX kernels" in log_path.read_text()
