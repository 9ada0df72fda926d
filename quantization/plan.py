"""What to quantize and how: the endpoint spec's switches and the hardware, turned into a recipe.

Pure data in, pure data out, so that it can be tested without llmcompressor and handed to
the worker as JSON. The recipe is a compressed-tensors ``config_groups`` mapping, the form
llmcompressor's ``QuantizationModifier(config_groups=..., ignore=...)`` takes and the form
saved in the checkpoint's ``config.json`` under ``quantization_config``.

``scheme: auto`` follows the hardware profile: FP8 W8A8 on GPUs, INT8 W8A8 on CPUs. Both
use the same recipe: symmetric 8-bit weights with one scale per output channel (or one per
tensor, for comparison), static; activations quantized per token at run time (dynamic), so
no calibration data is needed. ``lm_head`` is never quantized.

Worked example, the demo ``gec`` spec on this CPU machine::

    plan_for(scheme="auto", quantize_attention=True, weight_granularity="channel",
             kv_cache=False, accelerator="cpu")
    → scheme "int8", targets ["Linear"], weights int/8/channel, activations int/8/token dynamic,
      ignore ["lm_head"], label "int8-w8a8-channel"
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

#: Module-name pattern of MLP projections (compressed-tensors matches ``re:`` targets with
#: ``re.match`` against names such as ``model.layers.0.mlp.gate_proj``).
MLP_TARGETS = ("re:.*\\.mlp\\..*",)
ALL_LINEAR = ("Linear",)
IGNORE = ("lm_head",)
SCHEMES = ("fp8", "int8")


@dataclass(frozen=True)
class QuantizationPlan:
    scheme: str  # "fp8" or "int8"
    weight_granularity: str  # "channel" or "tensor"
    quantize_attention: bool
    kv_cache: bool
    targets: tuple[str, ...] = ALL_LINEAR
    ignore: tuple[str, ...] = IGNORE
    notes: tuple[str, ...] = field(default=())

    @property
    def label(self) -> str:
        """Short name used in paths, logs and MLflow tags, e.g. ``fp8-w8a8-channel-mlp-only``."""
        parts = [self.scheme, "w8a8", self.weight_granularity]
        if not self.quantize_attention:
            parts.append("mlp-only")
        if self.kv_cache:
            parts.append("kv8")
        return "-".join(parts)

    def config_groups(self) -> dict:
        kind = "float" if self.scheme == "fp8" else "int"
        return {
            "group_0": {
                "targets": list(self.targets),
                "weights": {"num_bits": 8, "type": kind, "strategy": self.weight_granularity,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": kind, "strategy": "token",
                                      "symmetric": True, "dynamic": True},
            }
        }

    def kv_cache_scheme(self) -> dict | None:
        """FP8 KV cache with one static scale per tensor (needs calibration; data-free it stays 1.0)."""
        if not self.kv_cache:
            return None
        return {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}

    def to_json(self) -> dict:
        return asdict(self) | {"label": self.label, "config_groups": self.config_groups(),
                               "kv_cache_scheme": self.kv_cache_scheme()}


def resolve_scheme(scheme: str, accelerator: str) -> str:
    """``auto`` → ``fp8`` on ``cuda``, ``int8`` elsewhere; an explicit scheme stays as it is."""
    if scheme != "auto":
        return scheme
    return "fp8" if accelerator == "cuda" else "int8"


def plan_for(*, scheme: str, quantize_attention: bool, weight_granularity: str, kv_cache: bool,
             accelerator: str) -> QuantizationPlan | None:
    """The plan for a spec's ``quantization`` section on ``accelerator``; None for ``scheme: none``."""
    resolved = resolve_scheme(scheme, accelerator)
    if resolved == "none":
        return None
    if resolved not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; known: auto, fp8, int8, none")
    if weight_granularity not in ("channel", "tensor"):
        raise ValueError(f"unknown weight granularity {weight_granularity!r}; known: channel, tensor")
    notes = []
    if kv_cache:
        notes.append("kv_cache: the KV cache is kept in FP8 with a static scale; this trades quality "
                     "(longer contexts drift further) for memory, and the eval gate measures it")
    if not quantize_attention:
        notes.append("quantize_attention: false, so q/k/v/o projections stay in the checkpoint's dtype")
    return QuantizationPlan(
        scheme=resolved,
        weight_granularity=weight_granularity,
        quantize_attention=quantize_attention,
        kv_cache=kv_cache,
        targets=ALL_LINEAR if quantize_attention else MLP_TARGETS,
        notes=tuple(notes),
    )
