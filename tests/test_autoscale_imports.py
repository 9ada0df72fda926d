"""The autoscaling policies are pure: no policy module of ``autoscale`` imports anything that does I/O.

The policy modules are the package's own ``.py`` files; the ``autoscale.controller`` subpackage
is the part that gathers and applies, and does I/O by design. The one exception among the
policy modules is ``clock.MonotonicClock.now_s``, which imports ``time`` inside the method.
"""

import ast
import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import autoscale

FORBIDDEN = {"os", "time", "socket", "httpx", "aiohttp", "sqlalchemy", "requests", "subprocess", "pathlib",
             "threading", "asyncio"}
ALLOWED = {"__future__", "math", "dataclasses", "statistics", "typing", "collections", "bisect", "autoscale"}
LAZY_EXCEPTION = ("clock.py", "MonotonicClock.now_s", "time")
MODULES = sorted(Path(autoscale.__file__).parent.glob("*.py"))


def imports(tree: ast.Module) -> list[tuple[str, str]]:
    """(enclosing class.function or "<module>", top-level package) of every import in the file."""
    found = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((".".join(scope) or "<module>", alias.name.split(".")[0]) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.append((".".join(scope) or "<module>", (child.module or "autoscale").split(".")[0]))
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, [*scope, child.name])
            else:
                visit(child, scope)

    visit(tree, [])
    return found


def test_every_module_is_checked():
    assert {path.name for path in MODULES} >= {"__init__.py", "clock.py", "horizontal.py", "vertical.py",
                                               "forecast.py", "units.py", "victims.py"}


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_no_module_imports_io(path):
    for scope, package in imports(ast.parse(path.read_text())):
        if (path.name, scope, package) == LAZY_EXCEPTION:
            continue
        assert package not in FORBIDDEN, f"{path.name} imports {package} in {scope}"
        assert package in ALLOWED, f"{path.name} imports {package} in {scope}: not in the pure-stdlib list"


def test_the_clock_exception_is_still_the_lazy_import_it_claims_to_be():
    tree = ast.parse((Path(autoscale.__file__).parent / "clock.py").read_text())
    assert ("MonotonicClock.now_s", "time") in imports(tree)


def test_importing_the_package_loads_no_io_module():
    """Re-importing every module adds nothing outside the allowed list to ``sys.modules``.

    The AST check above is the strict one: this session has loaded os and friends already.
    """
    names = [f"autoscale.{info.name}" for info in pkgutil.iter_modules(autoscale.__path__) if not info.ispkg]
    assert len(names) == len(MODULES) - 1  # every policy module but __init__
    saved = {name: module for name, module in sys.modules.items()
             if name == "autoscale" or name.startswith("autoscale.")}
    for name in saved:
        del sys.modules[name]
    before = set(sys.modules)
    try:
        for name in names:
            importlib.import_module(name)
        added = {name.split(".")[0] for name in set(sys.modules) - before}
    finally:
        sys.modules.update(saved)
    assert added <= ALLOWED, f"importing autoscale loaded {sorted(added - ALLOWED)}"
