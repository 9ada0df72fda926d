"""The architecture's import contracts hold: ``[tool.importlinter]`` in pyproject.toml, checked by
import-linter through every chain of imports (what each contract states is written beside it)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOT_PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]


@pytest.fixture
def report(capsys):
    from importlinter.cli import lint_imports

    def run(config: Path) -> tuple[int, str]:
        exit_code = lint_imports(config_filename=str(config), no_cache=True, no_logo=True)
        return exit_code, capsys.readouterr().out

    return run


def test_every_import_contract_is_kept(report):
    exit_code, out = report(ROOT / "pyproject.toml")
    assert "0 broken" in out and exit_code == 0, out


def test_a_policy_that_imports_a_database_library_breaks_its_contract(report, tmp_path, monkeypatch):
    """The contracts can fail: a copy of the project where the horizontal autoscaler's policy
    imports SQLAlchemy is reported broken, with the chain."""
    copy = tmp_path / "project"
    for package in ROOT_PACKAGES:
        for source in (ROOT / package).rglob("*.py"):
            target = copy / source.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    (copy / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    policy = copy / "autoscale" / "horizontal.py"
    policy.write_text(policy.read_text().replace("from __future__ import annotations\n",
                                                 "from __future__ import annotations\n\nimport sqlalchemy\n", 1))
    # import-linter finds each package where Python would import it from: the copy, not this checkout
    monkeypatch.syspath_prepend(str(copy))
    monkeypatch.chdir(copy)  # `python -m pytest` put the working directory ('') first on sys.path
    for name in [name for name in sys.modules if name.split(".")[0] in ROOT_PACKAGES]:
        monkeypatch.delitem(sys.modules, name)
    exit_code, out = report(copy / "pyproject.toml")
    assert exit_code != 0 and "BROKEN" in out and "autoscale.horizontal -> sqlalchemy" in out, out


MAX_MODULE_LINES = 400  # STYLE: a module a reader can hold in mind


def test_every_module_is_at_most_400_lines():
    too_long = {str(path.relative_to(ROOT)): lines
                for package in ROOT_PACKAGES
                for path in sorted((ROOT / package).rglob("*.py"))
                if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert too_long == {}, f"split these modules (lines): {too_long}"
