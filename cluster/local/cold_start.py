"""A replica's cold start from a serving image, split into image, weights and engine start-up.

The supervisor measures the whole (life start → warm-up request answered) and asks the mount
daemons how long foreground reads waited on the registry, per layer, before and after:
waiting on the environment layer (plus mounting it) is the image's share, waiting on the model
layer is the weights' share, the rest is the engine starting (imports, model load from local
bytes, warm-up). Bytes fetched before ready count every byte the layers pulled meanwhile,
prefetch included.
"""

from __future__ import annotations

from pathlib import Path

from images.mounts import MountedImage
from serving.runtime.base import ReplicaLaunch


def _delta(before: dict, after: dict, key: str) -> float:
    return max(0.0, float(after.get(key, 0) or 0) - float(before.get(key, 0) or 0))


def cold_start_split(total_s: float, mount_s: float, before: dict[str, dict], after: dict[str, dict],
                     image_bytes: int, mode: str, warm_process: bool) -> dict:
    """The split, from the total, the mount time and the daemons' stats before and after.

    >>> after = {"env": {"seconds_waiting": 2.0, "bytes_fetched": 300},
    ...          "model": {"seconds_waiting": 0.5, "bytes_fetched": 100}}
    >>> split = cold_start_split(10.0, 1.0, {"env": {"seconds_waiting": 0}, "model": {}}, after, 4000, "kernel", False)
    >>> split["image_s"], split["weights_s"], split["engine_s"], split["bytes_before_ready"], split["share_before_ready"]
    (3.0, 0.5, 6.5, 400, 0.1)
    """
    image_s = mount_s + _delta(before.get("env", {}), after.get("env", {}), "seconds_waiting")
    weights_s = _delta(before.get("model", {}), after.get("model", {}), "seconds_waiting")
    fetched = sum(int(_delta(before.get(role, {}), after.get(role, {}), "bytes_fetched")) for role in after)
    return {"time_to_ready_s": round(total_s, 2), "image_s": round(image_s, 2), "weights_s": round(weights_s, 2),
            "engine_s": round(max(0.0, total_s - image_s - weights_s), 2), "bytes_before_ready": fetched,
            "image_bytes": image_bytes, "share_before_ready": round(fetched / image_bytes, 4) if image_bytes else None,
            "requests_before_ready": int(sum(_delta(before.get(r, {}), after.get(r, {}), "requests") for r in after)),
            "mount": mode, "warm_process": warm_process}


def launch_from_image(launch: ReplicaLaunch, mounted: MountedImage, project_root: Path) -> ReplicaLaunch:
    """The runtime's launch rewritten to run the image's environment: its interpreter, and none
    of this checkout's packages on the path (the image carries modelplane's own).

    >>> from images.ref import ImageRef
    >>> image = ImageRef("http://r", "m/x", "v1", "sha256:" + "0" * 64, "", "pyfunc", "/usr/bin/python3", "3.11.7", ())
    >>> mounted = MountedImage(image, Path("/mnt/env"), Path("/mnt/model"), "kernel", 0.0)
    >>> launch = launch_from_image(ReplicaLaunch(["/venv/bin/python", "-m", "x"], {"PYTHONPATH": "/repo:/extra"}),
    ...                            mounted, Path("/repo"))
    >>> launch.argv[0], launch.env["PYTHONPATH"]
    ('/mnt/env/bin/python', '/extra')
    """
    path = [p for p in launch.env.get("PYTHONPATH", "").split(":") if p and Path(p) != project_root]
    env = {**launch.env, "PYTHONPATH": ":".join(path), "VIRTUAL_ENV": str(mounted.env_dir)}
    return ReplicaLaunch(argv=[str(mounted.python), *launch.argv[1:]], env=env)
