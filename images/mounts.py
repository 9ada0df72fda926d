"""The layers replicas start from, mounted once and shared (the local backend's side).

A replica of a revision with a serving image (:class:`images.ref.ImageRef`) runs the
environment layer's ``bin/python`` and reads its model from the model layer, both mounted
from the registry through the lazy fetcher (:mod:`images.mount`). A layer is mounted at the
first replica that needs it and unmounted when the last one stops; its sector cache stays
on disk (bounded), so the next mount of the same layer starts warm. The daemon of each mount
reports its fetch statistics on request, from which the supervisor splits a cold start into
image, weights and engine start-up.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from images.mount.foreign import ForeignMount
from images.mount.front_ends import MountConfig, choose_mode
from images.mount.kernel import LoopMount, LoopMountConfig
from images.mount.process import FuseProcess
from images.mount.system import attached_loop_devices, kernel_paths_available, mounted_at, unmount
from images.ref import ImageRef, LayerRef

log = logging.getLogger("modelplane.images.mounts")
FILL_SIGNAL = signal.SIGUSR2  # images.mount.daemon starts the background fill on it


@dataclass(frozen=True)
class MountsConfig:
    mode: str = "auto"  # auto | kernel | fuse-dir
    max_cache_bytes: int | None = 20 << 30  # per layer's sector cache
    # each layer's start-up sectors: "background" streams them, in the order the runtime read
    # them, while it starts; "wait" fetches them before the mount appears; "off" fetches on read
    prefetch: str = "background"
    fill: str = "ready"  # the rest of the layer: "ready" (after the first replica is ready) | "now" | "off"
    stats_timeout_s: float = 2.0


@dataclass
class _Mounted:
    target: Path
    handle: LoopMount | FuseProcess | ForeignMount  # ForeignMount: left by a previous supervisor
    stats_file: Path
    mode: str
    users: int = 0
    filling: bool = False

    def running(self) -> bool:
        if isinstance(self.handle, ForeignMount):
            return self.handle.running()
        return (self.handle.fuse if isinstance(self.handle, LoopMount) else self.handle).running()

    def send_signal(self, sig: int) -> None:
        if isinstance(self.handle, ForeignMount):
            self.handle.send_signal(sig)
        elif self.running():
            (self.handle.fuse if isinstance(self.handle, LoopMount) else self.handle).child.send_signal(sig)


@dataclass(frozen=True)
class MountedImage:
    image: ImageRef
    env_dir: Path
    model_dir: Path
    mode: str
    mount_s: float  # what this acquire spent mounting, prefetch included (0: every layer was mounted already)
    layers: dict[str, Path] = field(default_factory=dict)  # role → mount point

    @property
    def python(self) -> Path:
        return self.env_dir / "bin" / "python"


class ImageMounts:
    def __init__(self, root: Path, config: MountsConfig = MountsConfig(), mount_config: MountConfig | None = None):
        self.root = Path(root)
        self.config = config
        # the FUSE files behind loop devices live under root/private, so a sweep can find them
        self.mount_config = mount_config or MountConfig(kernel=LoopMountConfig(private_root=str(self.root / "private")))
        self.mode = choose_mode(config.mode, kernel_paths_available() if config.mode == "auto" else (False, ""))
        self._mounted: dict[str, _Mounted] = {}  # key: registry/repo@data digest
        self._lock = threading.Lock()
        for directory in ("mnt", "private", "stats", "cache"):
            (self.root / directory).mkdir(parents=True, exist_ok=True)
        # what a previous supervisor left mounted: replicas may still read from it (adopted, or
        # taken down by sweep() once the supervisor has adopted its replicas)
        for target in sorted((self.root / "mnt").iterdir()):
            if mounted_at(target):
                self._mounted[target.name] = _Mounted(target, ForeignMount(target),
                                                      self.root / "stats" / f"{target.name}.json", "adopted")

    def mounted(self, image: ImageRef) -> bool:
        """Whether every layer of ``image`` is mounted (by this supervisor or the previous one)."""
        with self._lock:
            return all(self._key(image, layer) in self._mounted for layer in image.layers)

    def sweep(self) -> list[str]:
        """Take down what a supervisor that crashed or was killed left mounted under ``root`` and
        no adopted replica uses: the squashfs mounts, the loop devices on FUSE files, the FUSE
        mounts. Call it once the replicas were adopted. Returns what it did."""
        done = []
        with self._lock:
            unused = [key for key, m in self._mounted.items() if isinstance(m.handle, ForeignMount) and m.users <= 0]
            left = [self._mounted.pop(key) for key in unused]
        for mounted in left:
            self._unmount(mounted)
            done.append(f"unmounted {mounted.target}")
        in_use = {str(m.handle.fuse_dir) for m in self._mounted.values() if isinstance(m.handle, ForeignMount)}
        in_use |= {str(m.handle.private_dir) for m in self._mounted.values() if isinstance(m.handle, LoopMount)}
        private = str(self.root / "private") + "/"
        for device, backing in attached_loop_devices().items():
            if backing.startswith(private) and str(Path(backing).parent) not in in_use:
                subprocess.run(["losetup", "-d", device], capture_output=True, check=False)
                done.append(f"detached {device}")
        for directory in sorted((self.root / "private").iterdir()):
            if mounted_at(directory) and str(directory) not in in_use:
                unmount(directory, fuse=True, busy_grace_s=1.0)
                done.append(f"unmounted {directory}")
        for line in done:
            log.warning("left by an earlier supervisor: %s", line)
        return done

    @staticmethod
    def _key(image: ImageRef, layer: LayerRef) -> str:
        """The layer's mount point name: its role and data digest (the same bytes from any registry)."""
        return f"{layer.role}-{layer.data_digest.split(':', 1)[1][:20]}"

    def acquire(self, image: ImageRef) -> MountedImage:
        """Mount the image's layers (or take the mounts already there); check its interpreter."""
        if not os.access(image.python, os.X_OK):
            raise RuntimeError(f"image {image.reference} runs on {image.python} (Python {image.python_version}), "
                               "which this machine does not have: build the image here, or install that Python")
        started = time.monotonic()
        with self._lock:
            dirs = {}
            taken = []
            fresh = False
            try:
                for layer in image.layers:
                    key = self._key(image, layer)
                    if key not in self._mounted:
                        self._mounted[key] = self._mount(image, layer)
                        fresh = True
                    self._mounted[key].users += 1
                    taken.append(key)
                    dirs[layer.role] = self._mounted[key].target
            except BaseException:
                self._release_keys(taken)
                raise
        mount_s = round(time.monotonic() - started, 3) if fresh else 0.0
        return MountedImage(image, dirs["env"], dirs["model"], self.mode, mount_s, dirs)

    def release(self, image: ImageRef) -> bool:
        """One user fewer; True when that unmounted a layer (anything running from it must go)."""
        with self._lock:
            return self._release_keys([self._key(image, layer) for layer in image.layers])

    def _release_keys(self, keys: list[str]) -> bool:
        unmounted = False
        for key in keys:
            mounted = self._mounted.get(key)
            if mounted is None:
                continue
            mounted.users -= 1
            if mounted.users <= 0:
                del self._mounted[key]
                self._unmount(mounted)
                unmounted = True
        return unmounted

    def ready(self, image: ImageRef) -> None:
        """A replica from this image is ready: start filling the rest of its layers (fill: ready)."""
        if self.config.fill != "ready":
            return
        with self._lock:
            for layer in image.layers:
                mounted = self._mounted.get(self._key(image, layer))
                if mounted is not None and not mounted.filling and mounted.running():
                    mounted.send_signal(FILL_SIGNAL)
                    mounted.filling = True

    def fetch_stats(self, image: ImageRef) -> dict[str, dict]:
        """Per role, the fetch statistics of the layer's daemon now ({} for a layer it could not tell)."""
        with self._lock:
            mounts = {layer.role: self._mounted.get(self._key(image, layer)) for layer in image.layers}
        before = {role: _mtime(m.stats_file) for role, m in mounts.items() if m is not None}
        for mounted in mounts.values():
            if mounted is not None:
                mounted.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + self.config.stats_timeout_s
        out = {}
        for role, mounted in mounts.items():
            if mounted is None:
                out[role] = {}
                continue
            while _mtime(mounted.stats_file) == before[role] and time.monotonic() < deadline:
                time.sleep(0.01)
            try:
                out[role] = json.loads(mounted.stats_file.read_text())
            except (OSError, ValueError):
                out[role] = {}
        return out

    def close(self) -> None:
        with self._lock:
            mounted, self._mounted = list(self._mounted.values()), {}
        for each in mounted:
            self._unmount(each)

    # -- one layer ----------------------------------------------------------------------------
    def _mount(self, image: ImageRef, layer: LayerRef) -> _Mounted:
        name = self._key(image, layer)
        target = self.root / "mnt" / name
        stats_file = self.root / "stats" / f"{name}.json"
        target.mkdir(exist_ok=True)
        stats_file.unlink(missing_ok=True)
        spec = {"kind": "registry", "url": image.registry, "repo": image.repo, "index_digest": layer.index_digest,
                "cache_root": str(self.root / "cache"), "max_cache_bytes": self.config.max_cache_bytes,
                "prefetch": {"background": True, "wait": "wait", "off": False}[self.config.prefetch], "fill": "now" if self.config.fill == "now" else
                ("signal" if self.config.fill == "ready" else "off")}
        started = time.monotonic()
        if self.mode == "kernel":
            handle = LoopMount.open(spec, target, config=self.mount_config.kernel, stats_file=stats_file)
        else:
            handle = FuseProcess.start("dir", spec, target, config=self.mount_config.fuse_dir, stats_file=stats_file)
        log.info("mounted %s layer of %s at %s (%s, %.1f s)", layer.role, image.reference, target, self.mode,
                 time.monotonic() - started)
        return _Mounted(target, handle, stats_file, self.mode)

    def _unmount(self, mounted: _Mounted) -> None:
        try:
            mounted.handle.stop() if isinstance(mounted.handle, FuseProcess) else mounted.handle.close()
        except Exception:  # noqa: BLE001 - one stuck mount must not keep the others mounted
            log.exception("unmounting %s failed", mounted.target)
        else:
            try:
                mounted.target.rmdir()  # empty once unmounted; never a recursive delete under a mount
            except OSError:
                pass


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0



def sweep_leftovers(root: Path) -> list[str]:
    """Take down whatever is still mounted under a mounts ``root`` (a supervisor that was killed
    before it could unmount): what ``modelplane up`` does after its services stopped."""
    if not (Path(root) / "mnt").is_dir():
        return []
    return ImageMounts(Path(root)).sweep()
