"""The hardware profile replicas run on: what a benchmark or a quantization choice is valid for.

A profile names the accelerator kind, the CPU model and cores, and the GPU model and count.
Figures measured on one profile (cost coefficients, the engine's support for a scheme) are
not reused on another; ``key`` is what they are stored under.

    >>> HardwareProfile("cpu", "AMD EPYC 7B13", 2.0).key
    'cpu/AMD EPYC 7B13/2cpu'
    >>> HardwareProfile("cuda", "Intel Xeon", 16.0, "NVIDIA H200", 1).key
    'cuda/NVIDIA H200x1'
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

from serving.runtime import cpu


@dataclass(frozen=True)
class HardwareProfile:
    accelerator: str  # "cpu" or "cuda"
    cpu_model: str
    cpu_cores: float  # the replica's CPU quota (cgroup), not the host's core count
    gpu_name: str | None = None
    gpu_count: int = 0

    @property
    def key(self) -> str:
        if self.accelerator == "cuda":
            return f"cuda/{self.gpu_name}x{self.gpu_count}"
        return f"cpu/{self.cpu_model}/{self.cpu_cores:g}cpu"

    @property
    def engine(self) -> str:
        """The LLM engine build this profile runs: ``vllm-cuda`` or ``vllm-cpu``."""
        return "vllm-cuda" if self.accelerator == "cuda" else "vllm-cpu"


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


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


def detect_local(gpu_root: Path = Path("/proc/driver/nvidia/gpus")) -> HardwareProfile:
    """This machine, as a local-backend replica sees it."""
    cores = cpu.available_cpus()
    gpus = nvidia_gpus(gpu_root)
    if gpus:
        return HardwareProfile("cuda", cpu_model_name(), cores, gpus[0], len(gpus))
    return HardwareProfile("cpu", cpu_model_name(), cores)
