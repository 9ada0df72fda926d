"""What a benchmark ran on, and how it writes its JSON."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def machine() -> dict:
    """The hardware profile the figures belong to (``cluster.hardware``), plus memory and Python."""
    from cluster.hardware import detect_local

    profile = detect_local()
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu_model": profile.cpu_model, "cpus": profile.cpu_cores, "isa": list(profile.isa), "amx": profile.amx,
            "hardware_profile": profile.key, "memory_gib": round(memory_gib, 1), "python": platform.python_version(),
            "gpu": f"{profile.gpu_name} x{profile.gpu_count}" if profile.gpu_count else None}


def write_result(path: str | None, *, benchmark: str, ours: dict, anchor: dict, ratio: float, goal: str,
                 meets_goal: bool) -> dict:
    """The common JSON shape: {"benchmark", "ours", "anchor", "ratio", "goal", "meets_goal", "machine"}."""
    result = {"benchmark": benchmark, "ours": ours, "anchor": anchor, "ratio": round(ratio, 3), "goal": goal,
              "meets_goal": bool(meets_goal), "machine": machine()}
    text = json.dumps(result, indent=2)
    if path:
        Path(path).write_text(text + "\n")
    print(text)
    return result
