"""Time to first inference of a vLLM replica of SmolLM2 from its serving image, over a throttled link.

``.venv/bin/python -m benchmarks.cold_start [--quick] --json OUT.json``

The serving image (the vLLM runtime environment + SmolLM2-135M, > 1 GB) is built and pushed
to the embedded registry on 127.0.0.1; every byte the runs fetch crosses
:class:`benchmarks.throttle_proxy.ThrottlingProxy` (bandwidth, and a delay per request). For
each link, in alternating order, with ``--repeats`` runs each (min / median / max):

- ``full_pull`` (the anchor): download every layer (digests verified), extract, start the
  replica from the extracted tree — what a container runtime does without lazy loading;
- ``lazy``: mount the seekable form with an empty cache, no prefetch, start from the mount;
- ``lazy_prefetch`` (ours, the headline): the same, the start-up set streamed in start-up
  order while the runtime starts (the default);
- ``lazy_prefetch_first``: the start-up set fetched before the mount appears;
- ``warm_cache``: the layers' sector caches kept from a previous start on this node;
- ``warm_cache_warm_pool``: and a pre-started runtime process (imports done) takes the replica.

Each run ends when the replica has answered its first inference (the runtime's warm-up
request). Bytes and requests are what crossed the proxy. Conversion time and storage overhead
come from the image build. Goals, at 200 Mbit/s: ``lazy_prefetch`` ≥ 5× faster than
``full_pull``, and ≤ 25 % of the image's bytes fetched before ready.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.machine import write_result
from benchmarks.repeats import spread
from benchmarks.throttle_proxy import Link, ThrottlingProxy
from cluster.local.cold_start import launch_from_image
from controlplane.settings import REPO_ROOT
from images.mounts import ImageMounts, MountedImage, MountsConfig
from images.oci.client import HttpRegistry
from images.oci.layout import pull_image
from images.oci.server import EmbeddedRegistry
from images.ref import ENV_MOUNT, MODEL_MOUNT, ImageRef
from serving.runtime.base import ReplicaLaunch, RuntimeConfig
from serving.runtime.process import free_port, replica_environment, stop_server_session
from serving.runtime.registry import runtime_for
from serving.runtime.vllm_runtime import VllmRuntime, VllmSettings

HEADLINE = Link(200, 10)
LINKS = [Link(mbit, ms) for mbit in (50, 200, 1000) for ms in (1, 10, 50)]
SCENARIOS = ("full_pull", "lazy", "lazy_prefetch", "lazy_prefetch_first", "warm_cache", "warm_cache_warm_pool")
REPO, TAG = "bench/smollm2", "v1-vllm"


@dataclasses.dataclass
class Bench:
    work: Path
    proxy: ThrottlingProxy
    image: ImageRef  # as the replicas see it: its registry is the proxy
    runtime_config: RuntimeConfig
    timeout_s: float = 900.0
    runs: int = 0

    def launch(self, model_dir: Path, port: int) -> ReplicaLaunch:
        # the KV cache fixed at 2 GiB: every scenario allocates the same, whatever else holds memory
        return VllmRuntime(VllmSettings(kv_cache_max_gib=2)).command(model_dir, "127.0.0.1", port, self.runtime_config)

    def first_inference(self, launch: ReplicaLaunch, model_dir: Path, port: int, start=None) -> float:
        """Seconds from now until the replica answered its warm-up request; the replica is stopped after."""
        started = time.monotonic()
        self.runs += 1
        log_path = self.work / "logs" / f"run-{self.runs}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if start is None:
            with log_path.open("ab") as log:
                process = subprocess.Popen(launch.argv, env=replica_environment(launch.env), stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        else:
            process = start(launch, log_path)
        probe = runtime_for("vllm").probe_request(model_dir, self.runtime_config)
        try:
            with httpx.Client(timeout=5, trust_env=False) as http:
                while True:
                    if process.poll() is not None:
                        raise RuntimeError(f"replica exited with {process.returncode}; see {log_path}")
                    if time.monotonic() - started > self.timeout_s:
                        raise TimeoutError(f"replica not ready after {self.timeout_s} s; see {log_path}")
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                            answer = http.post(f"http://127.0.0.1:{port}{probe.path}", json=probe.json,
                                               timeout=self.timeout_s)
                            answer.raise_for_status()
                            return time.monotonic() - started
                    time.sleep(0.1)
        finally:
            stop_server_session(process)

    # -- the scenarios --------------------------------------------------------------------------
    def full_pull(self) -> dict:
        dest = self.work / "pulled"
        shutil.rmtree(dest, ignore_errors=True)
        self.proxy.reset_counters()
        started = time.monotonic()
        with HttpRegistry(self.proxy.url) as registry:
            pulled = pull_image(registry, REPO, TAG, dest)
        env, model = dest / ENV_MOUNT, dest / MODEL_MOUNT
        port = free_port()
        launch = self.launch(model, port)
        mounted = MountedImage(self.image, env, model, "extracted", 0.0)
        ready_s = self.first_inference(launch_from_image(launch, mounted, REPO_ROOT), model, port)
        result = {"seconds": time.monotonic() - started, "pull_s": pulled.download_s, "extract_s": pulled.extract_s,
                  "engine_s": ready_s, "bytes": self.proxy.bytes_down, "requests": self.proxy.requests}
        shutil.rmtree(dest, ignore_errors=True)
        return result

    def lazy(self, *, prefetch: str, warm_cache: bool = False, warm_pool: bool = False) -> dict:
        root = self.work / ("runtime-warm" if warm_cache else "runtime-cold")
        if not warm_cache:
            shutil.rmtree(root, ignore_errors=True)
        mounts = ImageMounts(root, MountsConfig(prefetch=prefetch, fill="off"))
        try:
            if warm_pool:  # the node has this image mounted and a zygote idle for it
                from cluster.local.warm_pool import WarmPool, WarmPoolConfig

                mounted = mounts.acquire(self.image)
                # a pool of this mount's own: a zygote outliving the mount it runs from dies of SIGBUS
                pool = WarmPool(WarmPoolConfig(size_per_kind=1, refill_delay_s=3600, log_dir=self.work / "zygotes"))
                port = free_port()
                launch = launch_from_image(self.launch(mounted.model_dir, port), mounted, REPO_ROOT)
                zygote = _ready_zygote(pool, launch)
                self.proxy.reset_counters()
                started = time.monotonic()
                ready_s = self.first_inference(launch, mounted.model_dir, port,
                                               start=lambda launch, log_path: zygote.assign(launch, log_path))
                pool.close()
                return {"seconds": time.monotonic() - started, "mount_s": 0.0, "engine_s": ready_s,
                        "bytes": self.proxy.bytes_down, "requests": self.proxy.requests}
            self.proxy.reset_counters()
            started = time.monotonic()
            mounted = mounts.acquire(self.image)
            port = free_port()
            launch = launch_from_image(self.launch(mounted.model_dir, port), mounted, REPO_ROOT)
            ready_s = self.first_inference(launch, mounted.model_dir, port)
            return {"seconds": time.monotonic() - started, "mount_s": mounted.mount_s, "engine_s": ready_s,
                    "bytes": self.proxy.bytes_down, "requests": self.proxy.requests}
        finally:
            mounts.close()


def _ready_zygote(pool, launch: ReplicaLaunch, timeout_s: float = 600.0):
    """A zygote of the pool, ready for ``launch``'s kind and interpreter (it is ours to assign)."""
    from cluster.local.warm_pool import PoolKey

    key = PoolKey.for_launch("vllm", launch)
    pool.warm(key, launch.env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        zygote = pool.take(key)
        if zygote is not None:
            return zygote
        time.sleep(0.2)
    raise TimeoutError("no warm zygote became ready")


def run(links: list[Link], repeats: int, work: Path, log=print) -> dict:
    from demo.smollm2 import build_smollm2_checkpoint
    from images.serving_image import build_serving_image

    with EmbeddedRegistry(work / "registry") as registry:
        model_dir = build_smollm2_checkpoint(work / "model")
        with HttpRegistry(registry.url) as client:
            image, facts = build_serving_image(client, REPO, TAG, model_dir, "vllm", {}, work / "build",
                                               work / "image-cache", log=log)
        log(f"image {image.reference}: {facts['image_bytes'] / 1e9:.2f} GB, built in {facts['build_s']} s")
        host, port = registry.url.split("://")[1].split(":")
        with ThrottlingProxy(host, int(port), HEADLINE) as proxy:
            bench = Bench(work, proxy, dataclasses.replace(image, registry=proxy.url), RuntimeConfig(model_name="bench"))
            proxy.set_link(Link(10_000, 0))
            log("priming the warm cache")
            bench.lazy(prefetch="background", warm_cache=True)
            runs = {"full_pull": bench.full_pull, "lazy": lambda: bench.lazy(prefetch="off"),
                    "lazy_prefetch": lambda: bench.lazy(prefetch="background"),
                    "lazy_prefetch_first": lambda: bench.lazy(prefetch="wait"),
                    "warm_cache": lambda: bench.lazy(prefetch="background", warm_cache=True),
                    "warm_cache_warm_pool": lambda: bench.lazy(prefetch="background", warm_cache=True, warm_pool=True)}
            points = {}
            for link in links:
                proxy.set_link(link)
                names = SCENARIOS if link == HEADLINE else ("full_pull", "lazy_prefetch")
                results = {name: [] for name in names}
                for repeat in range(repeats):
                    for name in names if repeat % 2 == 0 else tuple(reversed(names)):
                        log(f"{link.label()}: {name}, run {repeat + 1}/{repeats}")
                        results[name].append(runs[name]())
                        with (work / "runs.jsonl").open("a") as record:  # kept if a later run fails
                            record.write(json.dumps({"link": link.label(), "scenario": name,
                                                     **results[name][-1]}) + "\n")
                points[link.label()] = results
    return {"image": image, "facts": facts, "points": points}


def summarize(outcome: dict) -> dict:
    """The figures per link and scenario, the headline, and the goals."""
    facts, image = outcome["facts"], outcome["image"]
    seekable_bytes = sum(layer.data_bytes for layer in image.layers)
    table = {}
    for label, results in outcome["points"].items():
        table[label] = {name: {"seconds": spread([r["seconds"] for r in runs]),
                               "bytes": spread([r["bytes"] for r in runs]),
                               "requests": spread([r["requests"] for r in runs]),
                               **({"engine_s": spread([r["engine_s"] for r in runs])}),
                               **({"pull_s": spread([r["pull_s"] for r in runs]),
                                   "extract_s": spread([r["extract_s"] for r in runs])} if name == "full_pull" else {})}
                        for name, runs in results.items()}
    headline = outcome["points"][HEADLINE.label()]
    full = statistics.median(r["seconds"] for r in headline["full_pull"])
    ours = statistics.median(r["seconds"] for r in headline["lazy_prefetch"])
    share = statistics.median(r["bytes"] for r in headline["lazy_prefetch"]) / facts["image_bytes"]
    return {"table": table, "full_s": full, "ours_s": ours, "speedup": full / ours, "share_before_ready": share,
            "conversion": {"build_s": facts["build_s"], "layers": facts["layers"], "image_bytes": facts["image_bytes"],
                           "seekable_bytes": seekable_bytes,
                           "storage_overhead": round(seekable_bytes / facts["image_bytes"], 3)}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 200 Mbit/s, 10 ms link only, one run each")
    parser.add_argument("--repeats", type=int, help="runs per scenario and link (default 5; --quick 1)")
    parser.add_argument("--links", choices=["headline", "all"], help="default: all; --quick: headline")
    parser.add_argument("--work", type=Path, help="where the registry, caches and logs go (default: a temp dir)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 5)
    links = [HEADLINE] if (args.links or ("headline" if args.quick else "all")) == "headline" else LINKS
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cold-start-")))
        summary = summarize(run(links, repeats, work))
    write_result(args.json, benchmark="cold_start",
                 ours={"scenario": "lazy_prefetch", "seconds_median": round(summary["ours_s"], 2),
                       "share_of_image_before_ready": round(summary["share_before_ready"], 4),
                       "links": summary["table"], "conversion": summary["conversion"], "repeats": repeats},
                 anchor={"scenario": "full_pull (download + verify + extract, then start)",
                         "seconds_median": round(summary["full_s"], 2)},
                 ratio=summary["speedup"],
                 goal="at 200 Mbit/s and 10 ms per request: time to first inference ≥ 5× faster than a full pull, "
                      "≤ 25 % of the image's bytes fetched before ready",
                 meets_goal=summary["speedup"] >= 5 and summary["share_before_ready"] <= 0.25)


if __name__ == "__main__":
    main()
