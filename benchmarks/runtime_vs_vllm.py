"""modelplane's vLLM replica vs plain ``vllm serve`` defaults, on SmolLM2-135M, GEC-shaped load.

Ours: the argv and environment ``VllmRuntime.command`` gives the supervisor for the
downloaded MLflow model (thread binding to the replica's cores, sized KV cache, eager mode,
priority scheduling, no access log). Anchor: ``python -m vllm.entrypoints.openai.api_server
--model <the same checkpoint folder> --host 127.0.0.1 --port N`` with vLLM's defaults, plus
only what it needs to start on this machine: ``VLLM_HOST_IP=127.0.0.1`` and the KV cache
size ours uses, as ``VLLM_CPU_KVCACHE_SPACE`` (vLLM's default, 92 % of the NUMA node's
memory, is more than is free here, and the engine refuses to start).

Load: closed loop, ≈ 50-token grammar-correction prompts, ``max_tokens=50`` with
``ignore_eos`` (every answer is 50 tokens), at concurrency 1, 4, 16 (``--quick``: 1 and 4).
The two servers never run together; they alternate (ours, anchor, anchor, ours, ours,
anchor) over 3 repeats (``--quick``: 1), and every level is judged on the median of the
repeat-by-repeat ratios, with min and max beside it. Full mode then runs an ablation at the
highest concurrency: ours minus thread binding, ours compiled instead of eager, and ours
with jemalloc preloaded (one server at a time).

    .venv/bin/python -m benchmarks.runtime_vs_vllm [--quick] --json OUT.json
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.repeats import alternate, ratios, spread
from serving.runtime.process import free_port, running_server

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO_ROOT / ".modelplane" / "bench"
MAX_TOKENS = 50
GOAL = ("at every concurrency measured, median (over alternating repeats) throughput ratio >= 0.95 and p99 "
        "within 5 %, no failed request on either server; headline: the throughput ratio at the highest level")


# ---- servers --------------------------------------------------------------------------------

# ---- model and prompts ----------------------------------------------------------------------

def smollm2_model_dir(cache_dir: Path = CACHE_DIR / "smollm2") -> Path:
    """SmolLM2 converted once, logged to a private MLflow store and downloaded: an MLflow model dir."""
    from demo.smollm2 import build_smollm2_checkpoint, log_gec
    from pipelines.registry import MlflowRegistry

    downloaded = cache_dir / "downloaded"
    if (downloaded / "MLmodel").is_file():
        return downloaded
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    checkpoint = build_smollm2_checkpoint(cache_dir / "checkpoint")
    uri = f"sqlite:///{cache_dir / 'mlflow.db'}"
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    if client.get_experiment_by_name("modelplane-demo") is None:
        client.create_experiment("modelplane-demo", artifact_location=(cache_dir / "artifacts").as_uri())
    version = log_gec(uri, checkpoint, registered_model_name="gec")
    return MlflowRegistry(uri).download("gec", str(version.version), downloaded)


def gec_prompts(count: int = 256, seed: int = 0) -> list[str]:
    """Grammar-correction prompts of about 50 SmolLM2 tokens: four wrong sentences from the demo corpus."""
    from demo.tiny_llama import corpus

    pairs, rng = corpus(), random.Random(seed)
    return ["Correct the grammar of the text. Answer with the corrected text only.\nText: "
            + " ".join(wrong for wrong, _ in rng.sample(pairs, 4)) + "\nCorrected:" for _ in range(count)]


def mean_prompt_tokens(tokenizer_dir: Path, prompts: list[str]) -> float:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return sum(len(tokenizer(p)["input_ids"]) for p in prompts) / len(prompts)


# ---- load -------------------------------------------------------------------------------------

def engine_counters(base: str) -> tuple[float, float]:
    """(requests finished, output tokens generated) so far, from the server's ``/metrics``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    finished = tokens = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10, trust_env=False).text):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total":
                finished += sample.value
            elif sample.name == "vllm:generation_tokens_total":
                tokens += sample.value
    return finished, tokens


class WindowCounters:
    """Server-side counts over the measured window, read from ``/metrics`` by a timer thread.

    A closed loop of equal-length requests runs in lock-step waves (all 16 start and finish
    together), so counting whole requests that start and end inside the window is coarse:
    one wave more or less moves req/s by 16 / window. The engine's token counter is exact.
    """

    def __init__(self, base: str, warmup_s: float, duration_s: float) -> None:
        import threading

        self.base, self.warmup_s, self.duration_s = base, warmup_s, duration_s
        self.result: dict = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        time.sleep(self.warmup_s)
        start, (finished0, tokens0) = time.perf_counter(), engine_counters(self.base)
        time.sleep(self.duration_s)
        elapsed, (finished1, tokens1) = time.perf_counter() - start, engine_counters(self.base)
        self.result = {"server_requests_per_s": round((finished1 - finished0) / elapsed, 2),
                       "server_output_tokens_per_s": round((tokens1 - tokens0) / elapsed, 1)}

    def __enter__(self) -> WindowCounters:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join()


def measure(base: str, model: str, prompts: list[str], levels: list[int], duration_s: float,
            warmup_s: float) -> list[dict]:
    """One closed-loop run per concurrency level: client latencies plus server-side throughput."""
    from benchmarks.loadgen import closed_loop_openai

    def body(i: int) -> dict:
        return {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "temperature": 0.0}

    # Unmeasured load first: the first forward passes of a fresh engine are slower.
    closed_loop_openai(f"{base}/v1/completions", body, concurrency=4, duration_s=4.0, warmup_s=0.0)
    results = []
    for level in levels:
        with WindowCounters(base, warmup_s, duration_s) as counters:
            result = closed_loop_openai(f"{base}/v1/completions", body, concurrency=level, duration_s=duration_s,
                                        warmup_s=warmup_s)
        summary = result.summary() | counters.result | {"error_samples": result.error_samples[:2]}
        print(f"  concurrency {level}: {summary}", flush=True)
        results.append(summary)
    return results


def ours_launch(model_dir: Path, port: int, settings=None) -> tuple[list[str], dict[str, str]]:
    """What the supervisor would start for this replica (all of this machine's CPUs)."""
    from serving.runtime.base import RuntimeConfig
    from serving.runtime.vllm_runtime import VllmRuntime

    launch = VllmRuntime(settings).command(model_dir, "127.0.0.1", port, RuntimeConfig(model_name="gec"))
    return launch.argv, launch.env


def anchor_launch(checkpoint_dir: Path, port: int, kv_cache_gib: str) -> tuple[list[str], dict[str, str]]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint_dir),
            "--host", "127.0.0.1", "--port", str(port)]
    return argv, {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": kv_cache_gib}


def run_server(name: str, argv: list[str], env: dict[str, str], port: int, model: str, prompts: list[str],
               levels: list[int], duration_s: float, warmup_s: float) -> dict:
    print(f"{name}: {' '.join(argv[1:])}\n  env {env}", flush=True)
    with running_server(argv, env, port, CACHE_DIR / "logs" / f"{name}.log", cwd=REPO_ROOT) as (base, startup_s):
        print(f"  healthy after {startup_s:.1f} s", flush=True)
        levels_out = measure(base, model, prompts, levels, duration_s, warmup_s)
    return {"argv": argv[1:], "env": env, "startup_s": round(startup_s, 1), "levels": levels_out}


def judge(ours_runs: list[list[dict]], anchor_runs: list[list[dict]], levels: list[int],
          duration_s: float = 20.0) -> tuple[dict, bool, str]:
    """Per level: throughput and p99 ratios over the repeats; the goal must hold at *every* level.

    Goal at a level: median throughput ratio ≥ 0.95 and median p99 ratio ≤ 1.05, and no request
    failed on either server (an anchor with errors is no baseline to beat). A run in which no
    request finished inside the measured window has no p99: it counts as the window's length,
    the least its latency was (never NaN, which would make every median meaningless).
    """
    def p99_ms(run: dict) -> float:
        value = run["p99_ms"]
        return value if math.isfinite(value) else duration_s * 1000

    key = "server_output_tokens_per_s"  # exact; every answer is MAX_TOKENS long, so this is req/s × 50
    by_level, reasons = {}, []
    for index, level in enumerate(levels):
        ours = [run[index] for run in ours_runs]
        anchor = [run[index] for run in anchor_runs]
        throughput = spread(ratios([o[key] for o in ours], [a[key] for a in anchor]))
        p99 = spread(ratios([p99_ms(o) for o in ours], [p99_ms(a) for a in anchor]))
        errors = {"ours": sum(o["errors"] for o in ours), "anchor": sum(a["errors"] for a in anchor)}
        by_level[str(level)] = {"throughput_ratio": throughput, "p99_ratio": p99, "errors": errors,
                                "ours_tokens_per_s": spread([o[key] for o in ours]),
                                "anchor_tokens_per_s": spread([a[key] for a in anchor])}
        if errors["ours"] or errors["anchor"]:
            reasons.append(f"concurrency {level}: {errors['ours']} failed requests on ours, {errors['anchor']} on "
                           "the anchor")
        if throughput["median"] < 0.95:
            reasons.append(f"concurrency {level}: throughput ratio {throughput['median']} < 0.95")
        if not 0 < p99["median"] <= 1.05:
            reasons.append(f"concurrency {level}: p99 ratio {p99['median']} > 1.05")
    return by_level, not reasons, "; ".join(reasons)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 4, short levels, one repeat, no ablation")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--repeats", type=int, default=None, help="alternating runs of each server (default 3)")
    parser.add_argument("--no-ablation", action="store_true")
    args = parser.parse_args()

    from benchmarks.machine import write_result
    from serving.runtime.vllm_runtime import VllmSettings

    levels, duration_s, warmup_s = ([1, 4], 6.0, 2.0) if args.quick else ([1, 4, 16], 15.0, 3.0)
    repeats = args.repeats or (1 if args.quick else 3)
    model_dir = smollm2_model_dir()
    checkpoint = model_dir / "model"
    prompts = gec_prompts()
    prompt_tokens = mean_prompt_tokens(checkpoint, prompts)
    print(f"model {model_dir}; mean prompt {prompt_tokens:.1f} tokens", flush=True)

    port = free_port()
    argv, env = ours_launch(model_dir, port)
    anchor_argv, anchor_env = anchor_launch(checkpoint, port, env.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    runs = alternate({
        "ours": lambda: run_server("ours", argv, env, port, "gec", prompts, levels, duration_s, warmup_s),
        "anchor": lambda: run_server("anchor", anchor_argv, anchor_env, port, str(checkpoint), prompts, levels,
                                     duration_s, warmup_s),
    }, repeats)
    by_level, meets, reason = judge([r["levels"] for r in runs["ours"]], [r["levels"] for r in runs["anchor"]],
                                    levels, duration_s)
    top = by_level[str(levels[-1])]
    ours = {"argv": runs["ours"][0]["argv"], "env": runs["ours"][0]["env"],
            "startup_s": spread([r["startup_s"] for r in runs["ours"]]), "by_level": by_level,
            "runs": [r["levels"] for r in runs["ours"]], "repeats": repeats,
            "mean_prompt_tokens": round(prompt_tokens, 1), "output_tokens": MAX_TOKENS}
    anchor = {"argv": runs["anchor"][0]["argv"], "env": runs["anchor"][0]["env"],
              "startup_s": spread([r["startup_s"] for r in runs["anchor"]]),
              "runs": [r["levels"] for r in runs["anchor"]]}

    if not args.quick and not args.no_ablation:
        key, top_level = "server_output_tokens_per_s", levels[-1:]
        ours_top = statistics.median(r["levels"][-1][key] for r in runs["ours"])
        base_settings = VllmSettings()
        variants = {
            "minus_thread_binding": replace(base_settings, bind_threads=False),
            "minus_enforce_eager": replace(base_settings, enforce_eager_on_cpu=False),
            "plus_jemalloc": replace(base_settings, preload_jemalloc=True),
        }
        ablation = {}
        for name, settings in variants.items():
            v_argv, v_env = ours_launch(model_dir, port, settings)
            run = run_server(name, v_argv, v_env, port, "gec", prompts, top_level, duration_s, warmup_s)
            ablation[name] = {"startup_s": run["startup_s"], **run["levels"][-1],
                              "vs_ours_median": round(run["levels"][-1][key] / ours_top, 3) if ours_top else None}
        ours["ablation_at_top_concurrency"] = ablation

    write_result(args.json, benchmark="runtime_vs_vllm", ours=ours, anchor=anchor,
                 ratio=top["throughput_ratio"]["median"], goal=GOAL, meets_goal=meets, unmet_reason=reason)


if __name__ == "__main__":
    main()
