"""Building a version's serving image: two layers, each in two forms, pushed to a registry.

Layers: the runtime environment (:mod:`images.environment`, shared by every version served
on this environment, built once per fingerprint and cached; builders sharing the cache take
turns through a lock file, so a second waits and reads what the first built) and the model files. Each layer
is an ordinary tar+gzip OCI layer (any runtime can pull and run the image) and a seekable
squashfs image cut into digested sectors (:mod:`images.seekable`), with the files the runtime
opened while starting (:mod:`images.startup_trace`) placed first and their sectors listed as
the prefetch set. The seekable form is pushed as an artifact whose ``subject`` is the image.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from images.environment import Environment, environment_for, stage
from images.oci.layers import LayerInfo, build_layer
from images.oci.layout import ImageConfig, push_layout, write_layout
from images.oci.registry import Registry, sha256_digest
from images.ref import ENV_MOUNT, MODEL_MOUNT, ImageRef, LayerRef
from images.seekable.artifact import SeekableLayer, push_seekable
from images.seekable.build import build_seekable
from images.seekable.index import DEFAULT_SECTOR_BYTES, SectorIndex
from images.startup_trace import trace_startup
from images.trace_cache import cached_trace, trace_key
from serving.runtime.base import RuntimeConfig
from serving.runtime.process import exclusive, free_port
from serving.runtime.registry import runtime_for


@dataclass(frozen=True)
class ImageSettings:
    sector_bytes: int = DEFAULT_SECTOR_BYTES
    compression: str = "zstd"  # the squashfs compressor
    zstd_level: int = 3  # squashfs blocks and sectors (3: 6 s for 0.8 GB; 15: 95 s for 15 % less)
    squashfs_block_bytes: int = 128 << 10
    layer_compresslevel: int = 1  # ISA-L gzip level (0-3) of the ordinary layers (1: fast; the seekable form starts)
    trace_startup: bool = True  # record the files the runtime opens while starting, and place them first
    trace_timeout_s: float = 900.0


@dataclass
class BuiltLayer:
    role: str
    path: str  # in the image root
    layer: LayerInfo
    layer_file: Path
    index: SectorIndex
    index_file: Path
    data_file: Path
    filesystem_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)

    def meta(self) -> dict:
        return {"role": self.role, "path": self.path, "layer": self.layer.__dict__, "layer_file": str(self.layer_file),
                "index_file": str(self.index_file), "data_file": str(self.data_file),
                "filesystem_bytes": self.filesystem_bytes, "seconds": self.seconds}

    @classmethod
    def from_meta(cls, meta: dict) -> BuiltLayer:
        index_file = Path(meta["index_file"])
        return cls(meta["role"], meta["path"], LayerInfo(**meta["layer"]), Path(meta["layer_file"]),
                   SectorIndex.from_json(index_file.read_bytes()), index_file, Path(meta["data_file"]),
                   meta["filesystem_bytes"], dict(meta["seconds"]))


def build_both_forms(tree: Path, work: Path, role: str, path: str, first: list[str],
                     settings: ImageSettings) -> BuiltLayer:
    """The ordinary layer and the seekable form of ``tree``, in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    layer = build_layer(tree, work / "layer.tar.gz", prefix=path, compresslevel=settings.layer_compresslevel,
                        keep_times=True)
    layer_s = time.monotonic() - started
    started = time.monotonic()
    # file times kept: the environment's .pyc files are checked against them
    seekable = build_seekable(tree, work, first=first, compression=settings.compression,
                              block_bytes=settings.squashfs_block_bytes, sector_bytes=settings.sector_bytes,
                              level=settings.zstd_level, keep_times=True)
    seekable_s = time.monotonic() - started
    filesystem_bytes = seekable.image_path.stat().st_size
    seekable.image_path.unlink()  # the sectors hold it
    (work / "index.json").write_bytes(seekable.index.to_json())
    return BuiltLayer(role, path, layer, work / "layer.tar.gz", seekable.index, work / "index.json",
                      seekable.data_path, filesystem_bytes, {"layer_s": round(layer_s, 1), "seekable_s": round(seekable_s, 1)})


def trace_files(environment: Environment, env_tree: Path, model_dir: Path, runtime_config: dict, work: Path,
                settings: ImageSettings) -> dict[str, list[str]]:
    """The files a replica opens while it starts, run from ``env_tree`` (the staged environment)."""
    runtime = runtime_for(environment.runtime)
    config = RuntimeConfig(model_name="startup-trace", **runtime_config)
    port = free_port()
    launch = runtime.command(model_dir, "127.0.0.1", port, config)
    launch.argv[0] = str(env_tree / "bin" / "python")
    launch.env["PYTHONPATH"] = ""  # modelplane's packages come from the environment, not this checkout
    return trace_startup(launch, runtime.probe_request(model_dir, config), {"env": env_tree, "model": model_dir},
                         work, port, settings.trace_timeout_s)


def build_serving_image(registry: Registry, repo: str, tag: str, model_dir: Path, runtime: str, runtime_config: dict,
                        work_root: Path, cache_root: Path, settings: ImageSettings = ImageSettings(),
                        log: Callable[[str], None] = print, labels: dict[str, str] | None = None) -> tuple[ImageRef, dict]:
    """Build, push and describe the serving image of ``model_dir`` for ``runtime``; (ref, build facts)."""
    started = time.monotonic()
    environment = environment_for(runtime, model_dir)
    fingerprint = environment.fingerprint()
    env_cache = cache_root / f"env-{runtime}-{fingerprint[:24]}"
    work = work_root / "build"
    shutil.rmtree(work, ignore_errors=True)
    env_tree = work / "env-tree"

    def staged() -> Path:  # the environment as a tree: for the trace and the layer, when either is not cached
        return env_tree if env_tree.exists() else stage(environment, env_tree)

    def record() -> dict[str, list[str]]:
        log(f"recording the start-up trace of a {runtime} replica")
        return trace_files(environment, staged(), model_dir, runtime_config, work / "trace", settings)

    traced, trace_from = {"env": [], "model": []}, "off"
    if settings.trace_startup:
        traced, cached = cached_trace(cache_root, trace_key(fingerprint, runtime, runtime_config, model_dir), record)
        trace_from = "cache" if cached else "recorded"
        if cached:
            log(f"start-up trace of a {runtime} replica with these model files from the cache ({cache_root})")
    with exclusive(cache_root / f"{env_cache.name}.lock", log, f"the environment layer {env_cache.name}"):
        if (env_cache / "meta.json").is_file():
            env_layer = BuiltLayer.from_meta(json.loads((env_cache / "meta.json").read_text()))
            log(f"environment layer {env_layer.layer.digest[:19]} from the cache ({env_cache})")
        else:
            log(f"building the environment layer ({len(environment.distributions)} distributions)")
            shutil.rmtree(env_cache, ignore_errors=True)
            env_layer = build_both_forms(staged(), env_cache, "env", ENV_MOUNT, traced["env"], settings)
            tmp = env_cache / "meta.json.tmp"
            tmp.write_text(json.dumps(env_layer.meta()))
            os.replace(tmp, env_cache / "meta.json")
    model_layer = build_both_forms(Path(model_dir), work / "model", "model", MODEL_MOUNT, traced["model"], settings)
    layout = work / "layout"
    config = ImageConfig(env={"PATH": f"/{ENV_MOUNT}/bin:/usr/local/bin:/usr/bin:/bin", "VIRTUAL_ENV": f"/{ENV_MOUNT}"},
                         cmd=[f"/{ENV_MOUNT}/bin/python", "-m", _entry_module(runtime)],
                         labels={"org.modelplane.runtime": runtime, "org.modelplane.python": environment.python_home,
                                 "org.modelplane.python-version": environment.python_version,
                                 "org.modelplane.environment": fingerprint, **(labels or {})},
                         working_dir="/")
    manifest = write_layout(layout, [(env_layer.layer, env_layer.layer_file), (model_layer.layer, model_layer.layer_file)],
                            config, tag)
    push_started = time.monotonic()
    manifest = push_layout(registry, layout, repo, tag)
    seekable = push_seekable(registry, repo, manifest, [
        SeekableLayer(built.index, built.data_file,
                      {"org.modelplane.layer.digest": built.layer.digest, "org.modelplane.mount": "/" + built.path,
                       "org.modelplane.role": built.role})
        for built in (env_layer, model_layer)])
    push_s = time.monotonic() - push_started
    # the layer files were moved or linked into the layout: keep the cache's, drop this build's
    shutil.rmtree(work / "env-tree", ignore_errors=True)
    layers = tuple(LayerRef(b.role, b.path, b.layer.digest, b.layer.size, sha256_digest(b.index.to_json()),
                            b.index.data_digest, b.data_file.stat().st_size, b.filesystem_bytes, len(b.index.prefetch))
                   for b in (env_layer, model_layer))
    ref = ImageRef(registry.url, repo, tag, manifest.digest, seekable.digest, runtime,
                   str(Path(environment.python_home) / f"python{environment.python_version.rsplit('.', 1)[0]}"),
                   environment.python_version, layers)
    facts = {"build_s": round(time.monotonic() - started, 1), "push_s": round(push_s, 1),
             "image_bytes": sum(b.layer.size for b in (env_layer, model_layer)),
             "seekable_bytes": sum(layer.data_bytes for layer in layers),
             "filesystem_bytes": sum(layer.filesystem_bytes for layer in layers),
             "traced_files": {role: len(files) for role, files in traced.items()}, "trace": trace_from,
             "layers": {b.role: {"digest": b.layer.digest, "bytes": b.layer.size, **b.seconds}
                        for b in (env_layer, model_layer)}}
    return ref, facts


def _entry_module(runtime: str) -> str:
    return {"vllm": "vllm.entrypoints.openai.api_server", "pyfunc": "serving.runtime.pyfunc"}[runtime]
