"""What a benchmark ran on, and how it writes its JSON."""

from __future__ import annotations

import json
import math
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
                 meets_goal: bool, unmet_reason: str | None = None) -> dict:
    """The common JSON shape: {"benchmark", "ours", "anchor", "ratio", "goal", "meets_goal", "machine"}.

    A ratio that is not a finite number (an anchor that measured nothing) is written as 0 with
    the goal unmet and ``unmet_reason`` saying why: never ``Infinity``.
    """
    if not math.isfinite(ratio):
        unmet_reason = unmet_reason or f"the ratio was {ratio}: one side measured nothing"
        ratio, meets_goal = 0.0, False
    result = {"benchmark": benchmark, "ours": ours, "anchor": anchor, "ratio": round(ratio, 3), "goal": goal,
              "meets_goal": bool(meets_goal), "machine": machine()}
    if unmet_reason and not meets_goal:
        result["unmet_reason"] = unmet_reason
    text = json.dumps(result, indent=2)
    if path:
        Path(path).write_text(text + "\n")
    print(text)
    return result
