"""The quantization plan: spec switches and hardware → the recipe saved in the checkpoint."""

import pytest

from cluster.hardware import HardwareProfile
from quantization.engine_support import check_supported, unsupported_reason
from quantization.plan import MLP_TARGETS, plan_for, resolve_scheme


def plan(**overrides):
    settings = {"scheme": "auto", "quantize_attention": True, "weight_granularity": "channel", "kv_cache": False,
                "accelerator": "cpu"} | overrides
    return plan_for(**settings)


@pytest.mark.parametrize("accelerator, expected", [("cuda", "fp8"), ("cpu", "int8")])
def test_auto_follows_the_hardware(accelerator, expected):
    assert resolve_scheme("auto", accelerator) == expected
    assert plan(accelerator=accelerator).scheme == expected


def test_an_explicit_scheme_is_kept_on_any_hardware():
    assert plan(scheme="fp8", accelerator="cpu").scheme == "fp8"
    assert plan(scheme="int8", accelerator="cuda").scheme == "int8"


def test_scheme_none_means_no_plan():
    assert plan(scheme="none") is None


def test_default_is_w8a8_per_channel_weights_dynamic_per_token_activations_lm_head_kept():
    group = plan(scheme="fp8").config_groups()["group_0"]
    assert group["targets"] == ["Linear"]
    assert group["weights"] == {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                "dynamic": False}
    assert group["input_activations"] == {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                          "dynamic": True}
    assert plan().ignore == ("lm_head",)
    assert plan().kv_cache_scheme() is None


def test_int8_uses_the_same_recipe_with_integer_types():
    group = plan(scheme="int8").config_groups()["group_0"]
    assert group["weights"]["type"] == group["input_activations"]["type"] == "int"
    assert group["weights"]["strategy"] == "channel"


def test_switches_change_targets_granularity_and_kv_cache():
    assert plan(quantize_attention=False).config_groups()["group_0"]["targets"] == list(MLP_TARGETS)
    assert plan(weight_granularity="tensor").config_groups()["group_0"]["weights"]["strategy"] == "tensor"
    kv = plan(kv_cache=True)
    assert kv.kv_cache_scheme()["type"] == "float"
    assert any("trades quality" in note for note in kv.notes)


def test_labels_name_every_choice():
    assert plan().label == "int8-w8a8-channel"
    assert plan(scheme="fp8", quantize_attention=False, kv_cache=True).label == "fp8-w8a8-channel-mlp-only-kv8"


def test_unknown_granularity_is_refused():
    with pytest.raises(ValueError, match="granularity"):
        plan(weight_granularity="group")


def test_per_tensor_fp8_is_refused_on_vllm_cpu_naming_scheme_and_engine():
    fp8_tensor = plan(scheme="fp8", weight_granularity="tensor")
    assert unsupported_reason(fp8_tensor, "vllm-cuda") is None
    with pytest.raises(ValueError, match=r"fp8-w8a8-tensor cannot run on vllm-cpu: .*static_scaled_fp8_quant"):
        check_supported(fp8_tensor, "vllm-cpu")


@pytest.mark.parametrize("scheme, granularity", [("int8", "channel"), ("int8", "tensor"), ("fp8", "channel")])
def test_what_vllm_cpu_runs_passes(scheme, granularity):
    check_supported(plan(scheme=scheme, weight_granularity=granularity), "vllm-cpu")


def test_hardware_profiles_are_keyed_by_what_they_run_on():
    cpu = HardwareProfile("cpu", "AMD EPYC 7B13", 2.0)
    gpu = HardwareProfile("cuda", "Intel Xeon", 16.0, "NVIDIA H200", 1)
    assert (cpu.key, cpu.engine) == ("cpu/AMD EPYC 7B13/2cpu", "vllm-cpu")
    assert (gpu.key, gpu.engine) == ("cuda/NVIDIA H200x1", "vllm-cuda")
    assert HardwareProfile("cpu", "AMD EPYC 7B13", 4.0).key != cpu.key


def test_the_local_profile_reads_gpus_from_the_driver_files(tmp_path):
    from cluster.hardware import detect_local

    assert detect_local(tmp_path / "none").accelerator == "cpu"
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        (tmp_path / "gpus" / bus).mkdir(parents=True)
        (tmp_path / "gpus" / bus / "information").write_text("Model: \t\t NVIDIA H200\nIRQ: 42\n")
    profile = detect_local(tmp_path / "gpus")
    assert (profile.accelerator, profile.gpu_name, profile.gpu_count) == ("cuda", "NVIDIA H200", 2)
    assert profile.key == "cuda/NVIDIA H200x2"
