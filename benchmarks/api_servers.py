"""vLLM with one API server process vs two, on the tiny Llama, same closed-loop load.

``--api-server-count N`` runs N front-end processes (HTTP, tokenization, detokenization)
in front of one engine. On a tiny model the front end, not the model, is the bottleneck,
so this is where a second one could pay; on a 2-core machine both compete with the engine
for the same cores. Both runs use ``VllmRuntime.command`` (the replica modelplane starts),
differing only in ``RuntimeConfig.api_server_count``, and alternate over 3 repeats
(``--quick``: 1). Ratio = 2 servers / 1 server, the median of the repeat-by-repeat ratios.

Goal: ≥ 1.10 with no failed request. A second front end costs about 1 GiB per replica; below
a 10 % gain it is not worth it, and ``replica.api_server_count`` stays 1 by default.

    .venv/bin/python -m benchmarks.api_servers [--quick] --json OUT.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.runtime_vs_vllm import CACHE_DIR, REPO_ROOT, WindowCounters
from serving.runtime.process import free_port, running_server

CONCURRENCY = 16
MAX_TOKENS = 16


def tiny_llama_checkpoint(out_dir: Path) -> Path:
    """``demo.tiny_llama`` built once into ``out_dir`` (its heads of 32 suit vLLM's CPU attention)."""
    from demo.tiny_llama import build_tiny_llama

    out_dir = Path(out_dir)
    return out_dir if (out_dir / "config.json").is_file() else build_tiny_llama(out_dir)


def short_prompts() -> list[str]:
    from demo.tiny_llama import corpus

    return [f"Fix: {wrong}" for wrong, _ in corpus()]


def run(api_server_count: int, checkpoint: Path, duration_s: float, warmup_s: float) -> dict:
    from benchmarks.loadgen import closed_loop_openai
    from serving.runtime.base import RuntimeConfig
    from serving.runtime.vllm_runtime import VllmRuntime

    port = free_port()
    launch = VllmRuntime().command(checkpoint, "127.0.0.1", port,
                                   RuntimeConfig(model_name="tiny", api_server_count=api_server_count))
    prompts = short_prompts()

    def body(i: int) -> dict:
        return {"model": "tiny", "prompt": prompts[i % len(prompts)], "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "temperature": 0.0}

    print(f"api-server-count {api_server_count}: {' '.join(launch.argv[1:])}\n  env {launch.env}", flush=True)
    log = CACHE_DIR / "logs" / f"api_servers_{api_server_count}.log"
    with running_server(launch.argv, launch.env, port, log, cwd=REPO_ROOT) as (base, startup_s):
        url = f"{base}/v1/completions"
        closed_loop_openai(url, body, concurrency=4, duration_s=2.0, warmup_s=0.0)  # first passes are slow
        with WindowCounters(base, warmup_s, duration_s) as counters:
            result = closed_loop_openai(url, body, concurrency=CONCURRENCY, duration_s=duration_s, warmup_s=warmup_s)
    summary = result.summary() | counters.result | {"api_server_count": api_server_count,
                                                    "startup_s": round(startup_s, 1),
                                                    "error_samples": result.error_samples[:2]}
    print(f"  {summary}", flush=True)
    return summary


GOAL = "2 API servers >= 1.10x the output tokens/s of 1 (median of alternating repeats), no failed request"
MIN_GAIN = 1.10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter load, one repeat")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()

    from benchmarks.machine import write_result
    from benchmarks.repeats import alternate, ratios, spread

    duration_s, warmup_s = (6.0, 2.0) if args.quick else (20.0, 3.0)
    checkpoint = tiny_llama_checkpoint(CACHE_DIR / "tiny-llama")
    runs = alternate({"one": lambda: run(1, checkpoint, duration_s, warmup_s),
                      "two": lambda: run(2, checkpoint, duration_s, warmup_s)}, 1 if args.quick else 3)
    key = "server_output_tokens_per_s"  # exact (see WindowCounters); every answer is MAX_TOKENS long
    throughput = spread(ratios([r[key] for r in runs["two"]], [r[key] for r in runs["one"]]))
    p99 = spread(ratios([r["p99_ms"] for r in runs["two"]], [r["p99_ms"] for r in runs["one"]]))
    errors = sum(r["errors"] for side in runs.values() for r in side)
    meets = throughput["median"] >= MIN_GAIN and errors == 0
    reason = (f"{errors} failed requests" if errors else
              f"2 API servers gave {throughput['median']}x, under {MIN_GAIN}x: keep 1 (the default)")
    write_result(args.json, benchmark="api_servers", ours={"runs": runs["two"], "throughput_ratio": throughput,
                                                           "p99_ratio": p99},
                 anchor={"runs": runs["one"]}, ratio=throughput["median"], goal=GOAL, meets_goal=meets,
                 unmet_reason=reason)


if __name__ == "__main__":
    main()
