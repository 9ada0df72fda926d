"""The hardware profile replicas run on: what a benchmark or a quantization choice is valid for.

A profile names the accelerator kind, the CPU model, its instruction-set features and
cores, whether Linux grants AMX state there, and the GPU model and count. Figures measured
on one profile (cost coefficients, the engine's support for a scheme) are not reused on
another; ``key`` is what they are stored under. A CPU profile's key carries the fastest
instruction set the engine's kernels will actually use (:func:`isa_level`): an Intel Xeon
whose AMX state Linux grants runs vLLM's AMX kernels, the same Xeon without it and an AMD
EPYC run AVX-512 ones, and a cost model measured on one does not hold on the other.

    >>> HardwareProfile("cpu", "AMD EPYC 7B13", 2.0).key
    'cpu/AMD EPYC 7B13/2cpu'
    >>> HardwareProfile("cpu", "AMD EPYC", 2.0, isa=("avx2", "avx512_bf16", "avx512_vnni", "avx512f")).key
    'cpu/AMD EPYC/avx512bf16/2cpu'
    >>> amx = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512f")
    >>> HardwareProfile("cpu", "Intel Xeon", 2.0, isa=amx, amx="granted").key
    'cpu/Intel Xeon/amx/2cpu'
    >>> HardwareProfile("cpu", "Intel Xeon", 2.0, isa=amx, amx="refused").key
    'cpu/Intel Xeon/avx512bf16/2cpu'
    >>> HardwareProfile("cuda", "Intel Xeon", 16.0, gpu_name="NVIDIA H200", gpu_count=1).key
    'cuda/NVIDIA H200x1'
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from serving.runtime import amx as amx_state
from serving.runtime import cpu

# The /proc/cpuinfo flags that decide which kernels an engine runs (x86-64, then aarch64).
ISA_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
                "amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "asimd", "sve")
# Fastest first: (flag, level named in the profile key).
ISA_LEVELS = (("avx512_bf16", "avx512bf16"), ("avx512_vnni", "avx512vnni"), ("avx512f", "avx512"), ("avx2", "avx2"),
              ("sve", "sve"), ("asimd", "neon"))


def isa_level(isa: tuple[str, ...], amx: str) -> str | None:
    """The fastest instruction set the engine will use: ``amx`` only where Linux grants it.

    >>> isa_level(("amx_tile", "avx512_bf16", "avx512f"), "granted"), isa_level(("amx_tile", "avx512f"), "refused")
    ('amx', 'avx512')
    >>> isa_level((), "absent") is None
    True
    """
    if "amx_tile" in isa and amx == "granted":
        return "amx"
    return next((level for flag, level in ISA_LEVELS if flag in isa), None)


@dataclass(frozen=True)
class HardwareProfile:
    accelerator: str  # "cpu" or "cuda"
    cpu_model: str
    cpu_cores: float  # the replica's CPU quota (cgroup), not the host's core count
    gpu_name: str | None = None
    gpu_count: int = 0
    isa: tuple[str, ...] = ()  # the ISA_FEATURES this CPU has, sorted
    amx: str = "absent"  # what a fresh engine process gets: granted | refused | absent | disabled

    @property
    def key(self) -> str:
        if self.accelerator == "cuda":
            return f"cuda/{self.gpu_name}x{self.gpu_count}"
        level = isa_level(self.isa, self.amx)
        return "/".join(["cpu", self.cpu_model, *([level] if level else []), f"{self.cpu_cores:g}cpu"])

    @property
    def engine(self) -> str:
        """The LLM engine build this profile runs: ``vllm-cuda`` or ``vllm-cpu``."""
        return "vllm-cuda" if self.accelerator == "cuda" else "vllm-cpu"

    def describe(self) -> dict:
        """For metadata and benchmark JSON: the key and what it was made from."""
        return {"key": self.key, "accelerator": self.accelerator, "cpu_model": self.cpu_model,
                "cpu_cores": self.cpu_cores, "isa": list(self.isa), "amx": self.amx,
                "gpu": f"{self.gpu_name} x{self.gpu_count}" if self.gpu_name else None}


def _cpuinfo_field(name: str, cpuinfo: Path) -> str | None:
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip()
    return None


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    return _cpuinfo_field("model name", cpuinfo) or platform.processor() or platform.machine()


def cpu_isa(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, ...]:
    """The :data:`ISA_FEATURES` in the first CPU's ``flags`` (x86) or ``Features`` (aarch64) line."""
    flags = set((_cpuinfo_field("flags", cpuinfo) or _cpuinfo_field("Features", cpuinfo) or "").split())
    return tuple(sorted(flags & set(ISA_FEATURES)))


@cache
def probe_amx(cpu_has_amx: bool) -> amx_state.AmxState:
    """What a fresh engine process on this machine gets, asked in a throwaway interpreter.

    Asking in this process would change it (a granted permission is for life, and a thread's
    small signal stack can make Linux refuse here what a fresh engine process gets).
    """
    if not cpu_has_amx:
        return amx_state.prepare(False, "auto", None)
    source_root = str(Path(amx_state.__file__).resolve().parents[2])
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from serving.runtime import amx; "
            "s = amx.prepare(True, 'auto', amx.linux_permission()); "
            "print(json.dumps([s.status, s.detail, s.permitted_mask]))")
    try:
        done = subprocess.run([sys.executable, "-S", "-c", code, source_root], capture_output=True, text=True,
                              timeout=30, check=True)
        status, detail, mask = json.loads(done.stdout)
        return amx_state.AmxState(status, detail, mask)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return amx_state.AmxState("refused", f"probing AMX state failed ({exc}); running without AMX kernels")


def nvidia_gpus(root: Path = Path("/proc/driver/nvidia/gpus")) -> list[str]:
    """Model names of the NVIDIA GPUs the driver reports (``<root>/<bus id>/information``).

    Read from the driver's files rather than through torch, so that light processes (the
    router, sensors) can tell the profile without importing a CUDA runtime.
    """
    names = []
    for info in sorted(root.glob("*/information")) if root.is_dir() else []:
        for line in info.read_text().splitlines():
            if line.startswith("Model:"):
                names.append(line.split(":", 1)[1].strip())
    return names


def detect_local(gpu_root: Path = Path("/proc/driver/nvidia/gpus"),
                 cpuinfo: Path = Path("/proc/cpuinfo")) -> HardwareProfile:
    """This machine, as a local-backend replica sees it."""
    cores = cpu.available_cpus()
    isa = cpu_isa(cpuinfo)
    amx = probe_amx("amx_tile" in isa).status
    gpus = nvidia_gpus(gpu_root)
    if gpus:
        return HardwareProfile("cuda", cpu_model_name(cpuinfo), cores, gpus[0], len(gpus), isa, amx)
    return HardwareProfile("cpu", cpu_model_name(cpuinfo), cores, isa=isa, amx=amx)


def local_gpu_count(driver_dir: Path = Path("/proc/driver/nvidia/gpus")) -> int:
    """NVIDIA GPUs the driver lists on this machine (0 without the driver), read without importing torch."""
    try:
        return sum(1 for entry in driver_dir.iterdir() if entry.is_dir())
    except OSError:
        return 0
