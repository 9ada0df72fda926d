"""Weight reconstruction error, read from saved files: what was saved is what is measured."""

import math

import pytest
import torch
from safetensors.torch import save_file

from quantization.reconstruction import layer_group, reconstruction_errors


def quantize_int8(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    absmax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().max().reshape(1)
    scale = absmax / 127
    return torch.round(weight / scale).clamp(-127, 127).to(torch.int8), scale


def save_pair(tmp_path, weights: dict[str, torch.Tensor], per_channel: bool):
    source, quantized = tmp_path / "source", tmp_path / ("channel" if per_channel else "tensor")
    source.mkdir(exist_ok=True)
    quantized.mkdir()
    save_file({f"{name}.weight": w for name, w in weights.items()}, source / "model.safetensors")
    packed = {}
    for name, w in weights.items():
        q, scale = quantize_int8(w, per_channel)
        packed |= {f"{name}.weight": q, f"{name}.weight_scale": scale}
    save_file(packed, quantized / "model.safetensors")
    return source, quantized


def test_the_worked_example_of_the_module_docstring(tmp_path):
    source, quantized = save_pair(tmp_path, {"model.layers.0.self_attn.q_proj": torch.tensor([[1.0, 2.0], [3.0, 4.0]])},
                                  per_channel=False)
    errors = reconstruction_errors(source, quantized)
    assert errors["quantized_layers"] == 1
    assert errors["groups"]["attention"] == pytest.approx(0.0196 / math.sqrt(30), rel=0.05)


def test_per_channel_beats_per_tensor_when_rows_differ_in_scale(tmp_path):
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 32, generator=generator) * torch.logspace(-2, 1, 64).unsqueeze(1)
    weights = {"model.layers.0.mlp.up_proj": rows, "model.layers.0.self_attn.o_proj": rows.flip(0)}
    channel = reconstruction_errors(*save_pair(tmp_path, weights, per_channel=True))
    tensor = reconstruction_errors(tmp_path / "source", save_pair(tmp_path, weights, per_channel=False)[1])
    for group in ("mlp", "attention"):
        assert channel["groups"][group] < tensor["groups"][group]


def test_a_scale_without_its_source_weight_is_an_error(tmp_path):
    source, quantized = save_pair(tmp_path, {"model.layers.0.mlp.up_proj": torch.ones(2, 2)}, per_channel=True)
    save_file({"other.weight": torch.ones(2, 2)}, source / "model.safetensors")
    with pytest.raises(ValueError, match="missing from"):
        reconstruction_errors(source, quantized)


@pytest.mark.parametrize("name, group", [
    ("model.layers.3.self_attn.q_proj.weight", "attention"),
    ("model.layers.3.mlp.down_proj.weight", "mlp"),
    ("transformer.h.0.attn.c_proj.weight", "attention"),
    ("lm_head.weight", "other"),
])
def test_layer_groups(name, group):
    assert layer_group(name) == group
